"""ActorRolloutRefWorker and CriticWorker on CPU gloo ranks with the tiny model.

One PPO update of the same batch on 1 rank, 2 ranks, 2 ranks x 4 micro-batches and 2 ranks with
token-budget micro-batches must give the same parameters (1e-5, fp32) and the same gradient norm;
both must match a float64 single-process reference written from the formulas. compute_log_prob
must equal log_softmax of the HF logits; the reference policy must equal the actor before any
update; a checkpoint loaded into a fresh worker must reproduce the next update exactly.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.workers_helpers import critic_step, hf_response_log_probs, make_batch, reference_actor_loss

NUM_ROWS = 8
LR = 1e-3
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
ENTROPY_COEFF = 0.01
KL_COEF = 0.1


def _configs(model_dir: str, micro: int | None = None, dynamic: bool = False, max_tokens: int = 64,
             agg: str = "token-mean", fsdp_size: int = -1, tis: float = -1.0):
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.workers.config import (
        ActorConfig,
        ActorRolloutRefConfig,
        CriticConfig,
        OptimConfig,
        RefConfig,
    )

    optim = OptimConfig(lr=LR, weight_decay=0.01, eps=1e-6)
    model = ModelConfig(path=model_dir, enable_gradient_checkpointing=True)
    actor = ActorConfig(ppo_mini_batch_size=NUM_ROWS, ppo_micro_batch_size_per_gpu=micro, use_dynamic_bsz=dynamic,
                        ppo_max_token_len_per_gpu=max_tokens, grad_clip=1e4, entropy_coeff=ENTROPY_COEFF,
                        use_kl_loss=True, kl_loss_coef=KL_COEF, kl_loss_type="low_var_kl", optim=optim,
                        loss_agg_mode=agg, fsdp_config=FSDPConfig(fsdp_size=fsdp_size), tis_imp_ratio_cap=tis,
                        **CLIP)
    arr = ActorRolloutRefConfig(model=model, actor=actor, ref=RefConfig(log_prob_micro_batch_size_per_gpu=3),
                                rollout=RolloutConfig(n=1, prompt_length=7, response_length=6,
                                                      log_prob_micro_batch_size_per_gpu=3))
    critic = CriticConfig(model=ModelConfig(path=model_dir, enable_gradient_checkpointing=False),
                          optim=OptimConfig(lr=LR, eps=1e-6), ppo_mini_batch_size=NUM_ROWS,
                          ppo_micro_batch_size_per_gpu=micro, use_dynamic_bsz=dynamic,
                          ppo_max_token_len_per_gpu=max_tokens, grad_clip=1e4, cliprange_value=0.2)
    return arr, critic


def _full_params(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone().cpu()
    return out


def _batch_proto(raw: dict):
    from tinyzero.protocol import DataProto

    keys = ["input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask", "advantages",
            "returns"]
    return DataProto.from_dict({k: raw[k] for k in keys}, meta_info={"temperature": 1.0})


def _my_chunk(data, worker):
    return data.chunk(worker.world_size)[worker.rank] if worker.world_size > 1 else data


def actor_rank_fn(model_dir: str, variants: list[dict], ckpt_dir: str | None):
    """On every rank: one update per variant (fresh workers); rank 0 returns the results."""
    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker

    init_distributed()
    torch.set_num_threads(1)
    raw = make_batch(NUM_ROWS)
    full = _batch_proto(raw)
    results = []
    for v in variants:
        set_seed(0)
        arr_cfg, critic_cfg = _configs(model_dir, **{k: x for k, x in v.items() if k != "checkpoint"})
        actor = ActorRolloutRefWorker(arr_cfg, "actor")
        actor.init_model()
        ref = ActorRolloutRefWorker(arr_cfg, "ref")
        ref.init_model()
        local = _my_chunk(full, actor)
        rows = torch.arange(len(full)).chunk(actor.world_size)[actor.rank]
        out = actor.compute_log_prob(local)
        ref_out = ref.compute_ref_log_prob(local)
        local.batch["old_log_probs"] = out.batch["old_log_probs"] + raw["noise_old"][rows]
        local.batch["ref_log_prob"] = ref_out.batch["ref_log_prob"] + raw["noise_ref"][rows]
        local.batch["rollout_log_probs"] = local.batch["old_log_probs"] + raw["noise_rollout"][rows]
        before = _full_params(actor.actor.model)
        metrics = actor.update_actor(local).meta_info["metrics"]
        res = {"variant": v, "metrics": metrics, "params": _full_params(actor.actor.model), "before": before,
               "log_probs": out.batch["old_log_probs"], "entropys": out.batch["entropys"],
               "ref_log_prob": ref_out.batch["ref_log_prob"], "rows": rows}
        # Critic: values, then one clipped value-loss update.
        res.update(critic_step(critic_cfg, local, raw["noise_values"][rows], _full_params))
        if ckpt_dir is not None and v.get("checkpoint"):
            res["resume"] = _checkpoint_roundtrip(actor, arr_cfg, local, ckpt_dir)
        results.append(res)
        del actor, ref
    return _portable(results) if int(os.environ["RANK"]) == 0 else None


def _portable(obj):
    """Tensors -> numpy arrays (torch tensors would travel as shared-memory handles of an exiting process)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(v) for v in obj)
    return obj


def _torch(obj):
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_torch(v) for v in obj)
    return obj


def _checkpoint_roundtrip(actor, cfg, local, ckpt_dir):
    """Save, run the next update; load into a fresh worker, run it again: both metrics."""
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker

    actor.save_checkpoint(ckpt_dir, global_step=1)
    local.save_to_disk(os.path.join(ckpt_dir, f"batch_rank{actor.rank}.pt"))
    next_a = actor.update_actor(copy.copy(local)).meta_info["metrics"]
    fresh = ActorRolloutRefWorker(cfg, "actor")
    fresh.init_model()
    fresh.load_checkpoint(ckpt_dir)
    next_b = fresh.update_actor(copy.copy(local)).meta_info["metrics"]
    return next_a, next_b, _full_params(actor.actor.model), _full_params(fresh.actor.model)


def resume_rank_fn(model_dir: str, ckpt_dir: str):
    """Load the 2-rank checkpoint on this world size and run the next update on the same rows."""
    from tinyzero.distributed import init_distributed
    from tinyzero.protocol import DataProto
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker

    init_distributed()
    torch.set_num_threads(1)
    from tinyzero.models.config import FSDPConfig

    cfg, _ = _configs(model_dir, dynamic=True, max_tokens=20)
    # Offloading between phases changes where tensors live, never the numbers.
    cfg.actor.fsdp_config = FSDPConfig(param_offload=True, optimizer_offload=True)
    worker = ActorRolloutRefWorker(cfg, "actor")
    worker.init_model()
    worker.load_checkpoint(ckpt_dir)
    full = DataProto.concat([DataProto.load_from_disk(os.path.join(ckpt_dir, f"batch_rank{r}.pt")) for r in (0, 1)])
    local = _my_chunk(full, worker)
    metrics = worker.update_actor(local).meta_info["metrics"]
    params = _full_params(worker.actor.model)
    return _portable((metrics, params)) if int(os.environ["RANK"]) == 0 else None


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("actor_ckpt"))
    one = run_distributed(actor_rank_fn, 1, tiny_model_dir, [{}], None, timeout=600)[0]
    # fsdp_size=1: hybrid sharding degenerated to pure replication (gradients all-reduced, averaged).
    variants = [{}, {"micro": 1}, {"micro": 1, "agg": "seq-mean-token-sum-norm"}, {"micro": 2, "fsdp_size": 1},
                {"micro": 3, "tis": 1.5},
                {"dynamic": True, "max_tokens": 20, "checkpoint": True}]
    two = run_distributed(actor_rank_fn, 2, tiny_model_dir, variants, ckpt, timeout=900)[0]
    two[-1]["resume_1_rank"] = run_distributed(resume_rank_fn, 1, tiny_model_dir, ckpt, timeout=600)[0]
    return _torch(one), _torch(two)


def _reference(model_dir: str, agg: str = "token-mean", tis: float = -1.0):
    """float64 single-process reference: loss, grad norm and parameters after one AdamW step."""
    from transformers import AutoModelForCausalLM

    raw = make_batch(NUM_ROWS)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        lp = hf_response_log_probs(model, raw)
    batch = dict(raw)
    batch["old_log_probs"] = lp + raw["noise_old"]
    batch["ref_log_prob"] = lp + raw["noise_ref"]
    batch["rollout_log_probs"] = batch["old_log_probs"] + raw["noise_rollout"]
    loss, pg_loss = reference_actor_loss(model, batch, CLIP["clip_ratio_low"], CLIP["clip_ratio_high"],
                                         CLIP["clip_ratio_c"], ENTROPY_COEFF, KL_COEF, loss_agg_mode=agg,
                                         tis_cap=tis)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.01)
    opt.step()
    return lp, float(pg_loss.detach()), float(grad_norm), {n: p.detach().float() for n, p in model.named_parameters()}


def _assert_params_close(a: dict, b: dict, atol: float = 1e-5):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_compute_log_prob_matches_hf(runs, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    one, two = runs
    raw = make_batch(NUM_ROWS)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    with torch.no_grad():
        ref_lp, ref_ent = hf_response_log_probs(model, raw, with_entropy=True)
    mask = raw["response_mask"].bool()
    got = one[0]
    torch.testing.assert_close(got["log_probs"][mask].double(), ref_lp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["entropys"][mask].double(), ref_ent[mask], rtol=0, atol=1e-5)
    # The reference policy equals the actor before any update.
    torch.testing.assert_close(got["ref_log_prob"][mask], got["log_probs"][mask], rtol=0, atol=1e-6)
    # Rank 0 of the 2-rank runs holds rows 0..3 (fixed and token-budget micro-batches alike).
    for res in two:
        rows = res["rows"]
        torch.testing.assert_close(res["log_probs"][mask[rows]].double(), ref_lp[rows][mask[rows]], rtol=0,
                                   atol=1e-5)


def test_actor_update_matches_reference_under_any_split(runs, tiny_model_dir):
    one, two = runs
    refs = {(agg, tis): _reference(tiny_model_dir, agg, tis)
            for agg, tis in (("token-mean", -1.0), ("seq-mean-token-sum-norm", -1.0), ("token-mean", 1.5))}
    for res in [one[0], *two]:
        v = res["variant"]
        _, ref_pg, ref_norm, ref_params = refs[(v.get("agg", "token-mean"), v.get("tis", -1.0))]
        m = res["metrics"]
        assert m["actor/grad_norm"] == pytest.approx(ref_norm, rel=1e-4), res["variant"]
        assert m["actor/pg_loss"] == pytest.approx(ref_pg, rel=1e-4, abs=1e-6), res["variant"]
        assert m["actor/lr"] == pytest.approx(LR)
        assert m["actor/pg_clipfrac"] > 0  # the clip is exercised
        # The step moved the parameters by about lr: the comparison below is meaningful.
        moved = max(float((res["params"][n] - res["before"][n]).abs().max()) for n in res["params"])
        assert moved > 0.5 * LR
        _assert_params_close(res["params"], ref_params, atol=1e-5)
    base = one[0]
    for res in two:
        if "agg" in res["variant"] or "tis" in res["variant"]:
            continue
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower",
                    "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert res["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-5, abs=1e-7), (key, res["variant"])
        _assert_params_close(res["params"], base["params"], atol=1e-5)


def test_critic_update_agrees_under_any_split(runs):
    one, two = runs
    base = one[0]
    assert base["critic_metrics"]["critic/vf_clipfrac"] > 0  # the value clip is exercised
    for res in two:
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            assert res["critic_metrics"][key] == pytest.approx(base["critic_metrics"][key], rel=1e-5, abs=1e-7), key
        _assert_params_close(res["critic_params"], base["critic_params"], atol=1e-5)
    rows = two[0]["rows"]
    torch.testing.assert_close(two[0]["values"], base["values"][rows], rtol=0, atol=1e-5)


def test_checkpoint_resume_reproduces_next_update(runs):
    _, two = runs
    next_a, next_b, params_a, params_b = two[-1]["resume"]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/lr"):
        assert next_a[key] == next_b[key], key
    _assert_params_close(params_a, params_b, atol=0.0)
    # Resharded onto 1 rank: the same next update up to float summation order.
    metrics_1, params_1 = two[-1]["resume_1_rank"]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/lr"):
        assert metrics_1[key] == pytest.approx(next_a[key], rel=1e-5), key
    _assert_params_close(params_1, params_a, atol=1e-5)


def _critic_reference(model_dir: str, old_values: torch.Tensor):
    """float64 clipped value loss of the whole batch, then one AdamW step; returns the parameters."""
    from tinyzero.models.value import load_value_model

    raw = make_batch(NUM_ROWS)
    model = load_value_model(model_dir).double()
    r = raw["responses"].shape[1]
    vpreds = model(input_ids=raw["input_ids"], attention_mask=raw["attention_mask"],
                   position_ids=raw["position_ids"]).logits[:, -r - 1:-1, 0]
    mask = raw["response_mask"].double()
    old = old_values.double() + raw["noise_values"].double() * mask
    clipped = torch.clamp(vpreds, old - 0.2, old + 0.2)
    loss_mat = torch.maximum((vpreds - raw["returns"]) ** 2, (clipped - raw["returns"]) ** 2)
    loss = 0.5 * (loss_mat * mask).sum() / mask.sum()
    loss.backward()
    grad_norm = float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())))
    torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.01).step()
    return float(loss.detach()), grad_norm, {n: p.detach().float() for n, p in model.named_parameters()}


def test_critic_update_matches_reference(runs, tiny_model_dir):
    one, _ = runs
    base = one[0]
    loss, grad_norm, params = _critic_reference(tiny_model_dir, base["values"])
    assert base["critic_metrics"]["critic/vf_loss"] == pytest.approx(loss, rel=1e-5)
    assert base["critic_metrics"]["critic/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    _assert_params_close(base["critic_params"], params, atol=1e-5)
