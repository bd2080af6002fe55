"""Hybrid sharding on a real 2 (replicate) x 2 (shard) mesh of 4 gloo ranks: one update equals 1 rank.

Each rank loads the tiny model by meta init + broadcast over the 2-D mesh, runs forward and
backward on its quarter of the batch, clips the gradient (the norm reduces over both mesh
axes) and takes one AdamW step. The reference is the plain model on one process with the whole
batch. Measured: loss, pre-clip gradient norm and every parameter after the step within 1e-5
(absolute and relative). AdamW runs with eps=1e-6 so the step is a smooth function of the
gradient (with eps=1e-8, gradients near 1e-9 turn fp32 summation-order noise into large steps).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow  # 4 spawned ranks: ~30 s on 2 idle cores

TOL = dict(atol=1e-5, rtol=1e-5)
ROWS, SEQ, MAX_NORM = 8, 12, 0.05
OPTIM = dict(lr=1e-3, eps=1e-6, weight_decay=0.01)


def _batch():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 256, (ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on two rows of different ranks
    mask[6, :2] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def _loss(model, ids, mask, pos, num_tokens):
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return (logits.float().square().mean(-1) * mask).sum() / num_tokens


def _hybrid_update(path: str):
    import torch.distributed as dist

    from tinyzero.distributed import init_distributed
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.fsdp import load_sharded_model, make_fsdp_mesh
    from tinyzero.workers.update import clip_grad_norm

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp_cfg = FSDPConfig(fsdp_size=2)
    mesh = make_fsdp_mesh(fsdp_cfg, "cpu")
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard") and tuple(mesh.shape) == (2, 2)
    model = load_sharded_model(ModelConfig(path=path, enable_gradient_checkpointing=False), fsdp_cfg, mesh)
    shards = {n: tuple(p.placements) for n, p in model.named_parameters()}
    model.train()
    ids, mask, pos = _batch()
    per = ROWS // world
    sl = slice(rank * per, (rank + 1) * per)
    # FSDP averages gradients over the 4 ranks: scale the local share of the global mean by 4.
    loss = _loss(model, ids[sl], mask[sl], pos[sl], mask.sum()) * world
    loss.backward()
    norm = clip_grad_norm(list(model.parameters()), MAX_NORM)
    torch.optim.AdamW(model.parameters(), **OPTIM).step()
    total = loss.detach() / world
    dist.all_reduce(total)
    params = {n: p.full_tensor().detach().numpy().copy() for n, p in model.named_parameters()}
    return float(total), float(norm), params, {n: [str(x) for x in pl] for n, pl in shards.items()}


def _reference(path: str):
    from tinyzero.models.loading import load_causal_lm

    model = load_causal_lm(path)
    model.train()
    ids, mask, pos = _batch()
    loss = _loss(model, ids, mask, pos, mask.sum())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    torch.optim.AdamW(model.parameters(), **OPTIM).step()
    return float(loss.detach()), float(norm), {n: p.detach().clone() for n, p in model.named_parameters()}


def test_hybrid_2x2_update_matches_one_rank(tiny_model_dir):
    results = run_distributed(_hybrid_update, 4, tiny_model_dir, timeout=600)
    ref_loss, ref_norm, ref_params = _reference(tiny_model_dir)
    assert ref_norm > MAX_NORM, "the clip must act for the test to cover it"
    for rank, (loss, norm, params, placements) in enumerate(results):
        # every parameter is replicated over axis 0 and sharded over axis 1
        assert all(p == ["R", "S(0)"] for p in placements.values()), (rank, placements)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (rank, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (rank, norm, ref_norm)
        assert params.keys() == ref_params.keys()
        for name, ref in ref_params.items():
            torch.testing.assert_close(torch.from_numpy(params[name]), ref, **TOL, msg=lambda m, n=name: f"{n}: {m}")
