"""The actor_rollout role (weight sync into the native engine), HF export and the reward-model worker.

On 2 CPU gloo ranks: greedy generation through ActorRolloutRefWorker.generate_sequences must
equal a plain greedy loop over the HF model with the actor's current weights, before and after
a PPO update (so the sync happened, and only when the weights changed); export_hf must reload
with `AutoModelForCausalLM.from_pretrained` holding exactly the actor's parameters; the reward
model's rm_scores must equal the score head on the HF backbone's hidden state at each row's
last valid token, and sit at the last valid response position.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_workers_actor import _full_params, _portable, _torch

RESPONSE_LEN = 5


def _prompts():
    """4 left-padded prompts of different lengths."""
    from tinyzero.protocol import DataProto

    g = torch.Generator().manual_seed(3)
    p = 6
    lengths = [6, 3, 4, 2]
    ids = torch.zeros(4, p, dtype=torch.long)
    mask = torch.zeros(4, p, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, p - n:] = torch.randint(3, 250, (n,), generator=g)
        mask[i, p - n:] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               meta_info={"do_sample": False})


def _text_batch(model_dir: str):
    """Prompt/response rows from real text (valid UTF-8, so decode -> encode round-trips)."""
    from transformers import AutoTokenizer

    from tinyzero.protocol import DataProto

    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs = [("What is 2+3?", "It is 5.<|im_end|>"), ("Say hi", "Hello there"),
             ("Count: 1 2", " 3 4<|im_end|>"), ("x", "y z w")]
    p = max(len(tok(a)["input_ids"]) for a, _ in pairs)
    r = max(len(tok(b)["input_ids"]) for _, b in pairs)
    ids = torch.full((4, p + r), tok.pad_token_id)
    mask = torch.zeros(4, p + r, dtype=torch.long)
    for i, (a, b) in enumerate(pairs):
        pa, rb = tok(a)["input_ids"], tok(b)["input_ids"]
        ids[i, p - len(pa):p], mask[i, p - len(pa):p] = torch.tensor(pa), 1
        ids[i, p:p + len(rb)], mask[i, p:p + len(rb)] = torch.tensor(rb), 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                "responses": ids[:, p:], "response_mask": mask[:, p:]})


def rollout_rank_fn(model_dir: str, export_dir: str):
    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.models.config import ModelConfig
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker
    from tinyzero.workers.config import ActorConfig, ActorRolloutRefConfig, OptimConfig, RewardModelConfig
    from tinyzero.workers.reward_model import RewardModelWorker

    init_distributed()
    torch.set_num_threads(1)
    set_seed(0)
    cfg = ActorRolloutRefConfig(
        model=ModelConfig(path=model_dir),
        actor=ActorConfig(ppo_mini_batch_size=4, optim=OptimConfig(lr=3e-2), grad_clip=1e4),
        rollout=RolloutConfig(n=1, prompt_length=6, response_length=RESPONSE_LEN, log_prob_micro_batch_size_per_gpu=2))
    worker = ActorRolloutRefWorker(cfg, "actor_rollout")
    worker.init_model()
    syncs = []
    engine_update = worker.rollout.update_weights
    worker.rollout.update_weights = lambda tensors: syncs.append(engine_update(tensors))
    prompts = _prompts()
    local = prompts.chunk(2)[worker.rank]
    gen_before = worker.generate_sequences(local)
    gen_again = worker.generate_sequences(local)  # weights unchanged: no second sync
    params_before = _full_params(worker.actor.model)
    batch = gen_before
    batch.meta_info.pop("metrics")
    batch.meta_info["temperature"] = 1.0
    old = worker.compute_log_prob(batch)
    old.meta_info.pop("metrics")
    batch = batch.union(old)
    g = torch.Generator().manual_seed(worker.rank)
    batch.batch["advantages"] = torch.randn(batch.batch["response_mask"].shape, generator=g)
    worker.update_actor(batch)
    gen_after = worker.generate_sequences(local)
    params_after = _full_params(worker.actor.model)
    worker.export_hf(export_dir)

    rm = RewardModelWorker(RewardModelConfig(enable=True, model=ModelConfig(path=model_dir), micro_batch_size_per_gpu=1))
    rm.init_model()
    rm_scores = rm.compute_rm_score(gen_after).batch["rm_scores"]
    # The same model reading decoded + re-encoded text (the path for a reward model with its own tokenizer).
    rm_cfg = RewardModelConfig(enable=True, model=ModelConfig(path=model_dir), input_tokenizer=model_dir)
    rm2 = RewardModelWorker(rm_cfg)
    rm2.init_model()
    text_batch = _text_batch(model_dir).chunk(2)[rm.rank]
    rm_scores_text = rm.compute_rm_score(text_batch).batch["rm_scores"]
    rm_scores_retok = rm2.compute_rm_score(text_batch).batch["rm_scores"]
    out = {"syncs": syncs, "gen_before": gen_before.batch, "gen_again": gen_again.batch,
           "gen_after": gen_after.batch, "params_before": params_before, "params_after": params_after,
           "rm_scores": rm_scores, "rm_scores_text": rm_scores_text, "rm_scores_retok": rm_scores_retok}
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in out.items()}
    return _portable(out) if int(os.environ["RANK"]) == 0 else None


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    export_dir = str(tmp_path_factory.mktemp("export") / "hf")
    res = run_distributed(rollout_rank_fn, 2, tiny_model_dir, export_dir, timeout=600)[0]
    return _torch(res), export_dir


def _greedy(model, prompt_ids: list[int], steps: int, eos_ids: set[int]) -> list[int]:
    """Plain greedy decoding: full forward per step, argmax of the last position."""
    ids = list(prompt_ids)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt in eos_ids:
                break
    return out


def _model_with(model_dir: str, params: dict):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    missing = model.load_state_dict(params, strict=False)
    assert not missing.unexpected_keys
    return model


@pytest.mark.slow
def test_generation_uses_current_actor_weights(run, tiny_model_dir):
    from transformers import AutoTokenizer, GenerationConfig

    res, _ = run
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # Generation stops at the tokenizer's eos and at every eos of the generation config.
    eos = {tok.eos_token_id, *GenerationConfig.from_pretrained(tiny_model_dir).eos_token_id}
    assert len(res["syncs"]) == 2  # the first generation and the one after the update; not the repeat
    assert torch.equal(res["gen_before"]["responses"], res["gen_again"]["responses"])
    assert not torch.equal(res["params_before"]["model.norm.weight"], res["params_after"]["model.norm.weight"])
    prompts = _prompts().chunk(2)[0]
    for key, params in (("gen_before", res["params_before"]), ("gen_after", res["params_after"])):
        model = _model_with(tiny_model_dir, params)
        gen = res[key]
        for i in range(len(prompts)):
            prompt = prompts.batch["input_ids"][i][prompts.batch["attention_mask"][i].bool()].tolist()
            n = int(gen["response_mask"][i].sum())
            assert gen["responses"][i, :n].tolist() == _greedy(model, prompt, RESPONSE_LEN, eos), (key, i)


def test_export_hf_reloads_actor_weights(run):
    from transformers import AutoModelForCausalLM

    res, export_dir = run
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    state = dict(model.named_parameters())
    for name, tensor in res["params_after"].items():
        assert torch.equal(state[name].detach(), tensor), name


def test_reward_model_scores_last_valid_token(run, tiny_model_dir):
    from tinyzero.models.value import load_reward_model

    res, _ = run
    with pytest.warns(UserWarning, match="no trained"):  # the tiny LM has no reward head yet
        model = load_reward_model(tiny_model_dir).eval()  # same deterministic head init as the worker
    gen = res["gen_after"]
    scores = res["rm_scores"]
    for i in range(scores.shape[0]):
        ids = gen["input_ids"][i][gen["attention_mask"][i].bool()]
        with torch.no_grad():
            hidden = model.model(input_ids=ids[None]).last_hidden_state[0, -1]
            expected = float(model.score(hidden)[0])
        n = int(gen["response_mask"][i].sum())
        assert scores[i, n - 1].item() == pytest.approx(expected, abs=1e-5)
        assert float(scores[i].abs().sum() - scores[i, n - 1].abs()) == 0.0


def test_reward_model_retokenized_input(run):
    res, _ = run
    # Byte-level tokenizer: decode -> encode reproduces the ids, so the scores are the same.
    torch.testing.assert_close(res["rm_scores_retok"], res["rm_scores_text"], rtol=0, atol=1e-5)
    assert res["rm_scores_text"].abs().sum() > 0
