"""Two DPO steps through the real driver (build_dpo_trainer, 2 gloo ranks, one pair per micro-batch)
against a float64 single-process reference written from the formulas.

The first step starts at policy == reference (h = 0, loss log 2); the second runs at h != 0, so the
sigmoid weighting, the pair grouping (chosen row 2i, rejected 2i+1), the preference sign and the loss
scaling over micro-batches and ranks are all exercised. Parameters must agree to 1e-5 (fp32 run).
"""

from __future__ import annotations

import copy
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.test_trainer_dpo_rm import write_prefs
from tests.workers_helpers import hf_response_log_probs

BETA, SMOOTHING, LR = 0.5, 0.1, 1e-3
PAIRS, MICRO_ROWS, STEPS = 8, 2, 2


def dpo_steps_rank_fn(model_dir: str, root: str):
    from tinyzero.cli import parse_args
    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.trainer.dpo import build_dpo_trainer

    init_distributed()
    torch.set_num_threads(1)
    cfg = parse_args([
        "dpo", "--preset", "dpo", f"--data.train_files={root}/train.parquet", "--data.val_files",
        f"--actor_rollout_ref.model.path={model_dir}", f"--trainer.default_local_dir={root}/run",
        "--data.max_length=12", "--data.apply_chat_template=false", f"--data.train_batch_size={PAIRS}",
        f"--actor_rollout_ref.actor.ppo_mini_batch_size={PAIRS}",
        f"--actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO_ROWS}",
        "--actor_rollout_ref.model.dtype=fp32", "--actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        f"--actor_rollout_ref.actor.optim.lr={LR}", "--actor_rollout_ref.actor.optim.eps=1e-6",
        "--actor_rollout_ref.actor.optim.warmup_style=constant", "--actor_rollout_ref.actor.grad_clip=1e4",
        f"--dpo.beta={BETA}", f"--dpo.label_smoothing={SMOOTHING}", f"--trainer.total_training_steps={STEPS}",
        "--trainer.device=cpu", "--trainer.progress_bar=false", "--trainer.plot=false",
    ])
    set_seed(0)
    trainer = build_dpo_trainer(cfg)
    try:
        batches = iter(trainer.loader)
        steps = []
        for _ in range(STEPS):
            pairs = next(batches)
            metrics = trainer.train_step(pairs)
            steps.append(({k: v.numpy() for k, v in pairs.batch.items()}, metrics))
        export = os.path.join(root, "hf")
        trainer.wg.export_hf(export)
    finally:
        trainer.close()
    return steps if int(os.environ["RANK"]) == 0 else None


def _rows(pairs: dict) -> dict:
    from tinyzero.protocol import DataProto
    from tinyzero.trainer.dpo import pairs_to_rows

    rows = pairs_to_rows(DataProto.from_dict({k: torch.from_numpy(v) for k, v in pairs.items()})).batch
    return {k: rows[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")}


def _reference(model_dir: str, batches: list[dict]):
    """float64: per step the loss, grad norm and reward margin, then one AdamW step; final parameters."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    ref = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    out = []
    for pairs in batches:
        rows = _rows(pairs)
        mask = rows["response_mask"].double()
        logp = hf_response_log_probs(model, rows)  # (2 * pairs, R)
        with torch.no_grad():
            ref_logp = hf_response_log_probs(ref, rows)
        ratio = ((logp - ref_logp) * mask).sum(-1)  # (2 * pairs,) log pi/ref of each sequence
        h = ratio[0::2] - ratio[1::2]  # chosen minus rejected
        loss = (-(1 - SMOOTHING) * F.logsigmoid(BETA * h) - SMOOTHING * F.logsigmoid(-BETA * h)).mean()
        loss.backward()
        grad_norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters()))
        opt.step()
        opt.zero_grad()
        out.append({"loss": float(loss.detach()), "grad_norm": grad_norm, "margin": float(BETA * h.detach().mean())})
    return out, {n: p.detach().float() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def dpo_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_steps")
    write_prefs(str(root / "train.parquet"), 64, seed=0)
    steps = run_distributed(dpo_steps_rank_fn, 2, tiny_model_dir, str(root), timeout=600)[0]
    return steps, str(root / "hf")


@pytest.mark.slow
def test_dpo_steps_match_float64_reference(dpo_run, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    steps, export = dpo_run
    ref_steps, ref_params = _reference(tiny_model_dir, [pairs for pairs, _ in steps])
    (_, first), (_, second) = steps
    assert first["train/loss"] == pytest.approx(math.log(2), rel=1e-6)  # policy == reference at the start
    assert first["train/rewards/margins"] == 0.0
    assert second["train/rewards/margins"] != 0.0  # the second step runs away from h = 0
    for (_, metrics), ref in zip(steps, ref_steps):
        assert metrics["train/loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert metrics["train/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert metrics["train/rewards/margins"] == pytest.approx(ref["margin"], rel=1e-4, abs=1e-7)
    trained = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    got = dict(trained.named_parameters())
    moved = max(float((got[n] - p).abs().max()) for n, p in initial.named_parameters())
    assert moved > LR  # two steps of about lr each: the comparison below is meaningful
    for name, want in ref_params.items():
        np.testing.assert_allclose(got[name].detach().numpy(), want.numpy(), rtol=0, atol=1e-5, err_msg=name)
