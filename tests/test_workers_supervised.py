"""SupervisedWorker's SFT step on CPU gloo ranks with the tiny model, against a float64 reference.

The reference is a plain loop over rows and target tokens: the NLL of input_ids[t + 1] under
log_softmax of the full HF logits at t, where loss_mask[t + 1] is 1, summed and divided by the
number of targets; then one AdamW step. One SFT step on 1 rank, on 2 ranks, with micro-batches,
padded and packed (use_remove_padding) must give that loss, gradient norm and parameters (fp32
against float64: loss and norm to 1e-4 relative, parameters to 1e-5).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed

NUM_ROWS = 8
LENGTH = 14
LR = 1e-3
PAD_ID = 0


def make_sft_batch(vocab: int = 250, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows of varied lengths; the loss mask covers each row's last tokens (its "response")."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (NUM_ROWS, LENGTH), generator=g)
    attn = torch.zeros(NUM_ROWS, LENGTH, dtype=torch.long)
    loss = torch.zeros(NUM_ROWS, LENGTH, dtype=torch.long)
    for i in range(NUM_ROWS):
        n = 3 + (i * 5) % (LENGTH - 2)  # 3..LENGTH
        prompt = 1 + i % 3  # 1..3 prompt tokens, never trained on
        attn[i, :n] = 1
        loss[i, prompt:n] = 1
    ids = torch.where(attn.bool(), ids, torch.full_like(ids, PAD_ID))
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "loss_mask": loss}


def _config(model_dir: str, micro: int | None, packing: bool):
    from tinyzero.models.config import ModelConfig
    from tinyzero.workers.config import ActorConfig, ActorRolloutRefConfig, OptimConfig

    optim = OptimConfig(lr=LR, weight_decay=0.01, eps=1e-6)
    model = ModelConfig(path=model_dir, enable_gradient_checkpointing=True, use_remove_padding=packing)
    actor = ActorConfig(ppo_micro_batch_size_per_gpu=micro, grad_clip=1e4, optim=optim)
    return ActorRolloutRefConfig(model=model, actor=actor)


def _full_params(model) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone().cpu().numpy()
            for name, p in model.named_parameters()}


def sft_rank_fn(model_dir: str, variants: list[dict]):
    """On every rank: one SFT step per variant (a fresh worker each); rank 0 returns the results."""
    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.protocol import DataProto
    from tinyzero.workers.supervised import SupervisedWorker

    init_distributed()
    torch.set_num_threads(1)
    full = DataProto.from_dict(make_sft_batch())
    results = []
    for v in variants:
        set_seed(0)
        worker = SupervisedWorker(_config(model_dir, **v), "sft")
        worker.init_model()
        local = full.chunk(worker.world_size)[worker.rank] if worker.world_size > 1 else full
        val = worker.eval_step(local).meta_info["metrics"]
        metrics = worker.train_step(local).meta_info["metrics"]
        results.append({"variant": v, "metrics": metrics, "val": val, "params": _full_params(worker.model)})
        del worker
    return results if int(os.environ["RANK"]) == 0 else None


def _reference(model_dir: str):
    """float64: (loss, grad norm, parameters after one AdamW step), the loss from a plain loop."""
    from transformers import AutoModelForCausalLM

    batch = make_sft_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for i in range(NUM_ROWS):
        n = int(batch["attention_mask"][i].sum())
        logits = model(input_ids=batch["input_ids"][i:i + 1, :n]).logits[0]  # (n, V), one unpadded row
        logp = torch.log_softmax(logits, dim=-1)
        for t in range(n - 1):
            if batch["loss_mask"][i, t + 1]:
                total = total - logp[t, batch["input_ids"][i, t + 1]]
                count += 1
    loss = total / count
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.01).step()
    return float(loss.detach()), float(grad_norm), {n: p.detach().float() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    one = run_distributed(sft_rank_fn, 1, tiny_model_dir, [{"micro": None, "packing": False}], timeout=600)[0]
    variants = [{"micro": 3, "packing": False}, {"micro": None, "packing": True}, {"micro": 3, "packing": True}]
    two = run_distributed(sft_rank_fn, 2, tiny_model_dir, variants, timeout=900)[0]
    return one + two


@pytest.mark.slow
def test_sft_step_matches_the_float64_loop_padded_and_packed(runs, tiny_model_dir):
    ref_loss, ref_norm, ref_params = _reference(tiny_model_dir)
    assert len(runs) == 4
    for res in runs:
        m = res["metrics"]
        assert res["val"]["val/loss"] == pytest.approx(ref_loss, rel=1e-4), res["variant"]
        assert m["train/loss"] == pytest.approx(ref_loss, rel=1e-4), res["variant"]
        assert m["train/grad_norm"] == pytest.approx(ref_norm, rel=1e-4), res["variant"]
        assert set(res["params"]) == set(ref_params)
        for name, ref in ref_params.items():
            torch.testing.assert_close(torch.from_numpy(res["params"][name]), ref, rtol=0, atol=1e-5,
                                       msg=lambda msg, n=name, v=res["variant"]: f"{v} {n}: {msg}")
