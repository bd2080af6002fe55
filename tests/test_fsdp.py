"""FSDP2 wrapping on gloo ranks: sharded forward/backward equals the unsharded model, rank-0 load +
broadcast equals a direct load, hybrid sharding, offload helpers."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

TOL = dict(atol=1e-5, rtol=1e-5)


def _batch(seed: int = 0, batch: int = 4, seq: int = 10):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded row
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


CASES = {
    # name: (fsdp_size, meta init + rank-0 broadcast, CPUOffloadPolicy, gradient checkpointing (0: off,
    #        n: every n-th layer), wrap_policy.min_num_params)
    "shard": (-1, False, False, 1, 0),
    "meta_init": (-1, True, False, False, 0),
    "hybrid": (1, True, False, 1, 0),  # 2-D mesh (replicate=2, shard=1): grads all-reduced across replicas
    "offload_policy": (-1, True, True, False, 0),
    "one_unit": (-1, True, False, False, 10**9),  # every layer left in the root unit
    "selective": (-1, True, False, 2, 0),  # layer 0 recomputed, layer 1 keeps its activations
}


def _run_cases(path: str, corrupt_path: str):
    """Every case of CASES in one set of processes (spawning ranks is the slow part on CPU)."""

    from tinyzero.distributed import init_distributed

    init_distributed()
    out = {name: _sharded_forward_backward(path, *case) for name, case in CASES.items()}
    out["value"] = _value_and_offload(path)
    out["corrupt"] = _load_corrupt(corrupt_path)
    return out


def _load_corrupt(path: str) -> str:
    """Loading a folder with an unreadable safetensors file fails on every rank (no hang)."""
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.fsdp import load_sharded_model, make_fsdp_mesh

    fsdp_cfg = FSDPConfig()
    try:
        load_sharded_model(ModelConfig(path=path), fsdp_cfg, make_fsdp_mesh(fsdp_cfg, "cpu"))
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _sharded_forward_backward(path: str, fsdp_size: int, use_meta_init: bool, offload_policy: bool,
                              checkpointing: int, min_num_params: int):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.fsdp import decoder_layers, load_sharded_model, make_fsdp_mesh, parallelize
    from tinyzero.models.loading import load_causal_lm
    from tinyzero.workers.update import clip_grad_norm

    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp_cfg = FSDPConfig(fsdp_size=fsdp_size, offload_policy=offload_policy,
                          wrap_policy={"min_num_params": min_num_params})
    mesh = make_fsdp_mesh(fsdp_cfg, "cpu")
    model_cfg = ModelConfig(path=path, enable_gradient_checkpointing=bool(checkpointing),
                            gradient_checkpointing_every_n_layers=max(1, int(checkpointing)))
    if use_meta_init:
        model = load_sharded_model(model_cfg, fsdp_cfg, mesh)
    else:
        model = parallelize(load_causal_lm(path), mesh, fsdp_cfg, enable_gradient_checkpointing=bool(checkpointing))
    assert mesh.ndim == (2 if fsdp_size == 1 else 1)
    model.train()
    ids, mask, pos = _batch()
    per = ids.shape[0] // world
    sl = slice(rank * per, (rank + 1) * per)
    logits = model(input_ids=ids[sl], attention_mask=mask[sl], position_ids=pos[sl]).logits
    # Sum over the local rows / global row count: FSDP averages grads over ranks -> scale by world.
    loss = (logits.float().square().mean(-1) * mask[sl]).sum() / mask.sum() * world
    loss.backward()
    norm = clip_grad_norm(list(model.parameters()), max_norm=1e9)
    full_logits = [None] * world
    dist.all_gather_object(full_logits, logits.detach())
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}
    # Tensors cross the process boundary as numpy (torch tensors would go through shared memory
    # that disappears when the rank exits).
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    recomputed = [bool(layer.gradient_checkpointing) for layer in decoder_layers(model)]
    return torch.cat(full_logits).numpy(), _np(params), _np(grads), float(norm), units, recomputed


def _np(d):
    return {k: v.numpy() for k, v in d.items()}


def _reference(path: str):
    from tinyzero.models.loading import load_causal_lm

    model = load_causal_lm(path)
    model.train()
    ids, mask, pos = _batch()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    loss = (logits.float().square().mean(-1) * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads.values()))
    return logits.detach(), dict(model.named_parameters()), grads, float(norm)


def _check_against_reference(results, ref):
    ref_logits, ref_params, ref_grads, ref_norm = ref
    for logits, params, grads, norm, *_ in results:
        logits = torch.from_numpy(logits)
        params = {k: torch.from_numpy(v) for k, v in params.items()}
        grads = {k: torch.from_numpy(v) for k, v in grads.items()}
        torch.testing.assert_close(logits, ref_logits, **TOL)
        assert params.keys() == ref_params.keys()
        for n in ref_params:
            torch.testing.assert_close(params[n], ref_params[n].detach(), atol=0, rtol=0)
            torch.testing.assert_close(grads[n], ref_grads[n], **TOL)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm


@pytest.fixture(scope="module")
def two_rank_results(tiny_model_dir, tmp_path_factory):
    import shutil

    corrupt = tmp_path_factory.mktemp("corrupt_model")
    shutil.copytree(tiny_model_dir, corrupt, dirs_exist_ok=True)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    return run_distributed(_run_cases, 2, tiny_model_dir, str(corrupt))


@pytest.mark.slow
def test_unreadable_weights_fail_every_rank(two_rank_results):
    rank0, rank1 = (r["corrupt"] for r in two_rank_results)
    assert rank0 != "loaded" and "could not load" not in rank0  # the source rank reports the real error
    assert rank1.startswith("ValueError") and "could not load" in rank1


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return _reference(tiny_model_dir)


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_two_ranks_match_unsharded(two_rank_results, reference, case):
    """shard: parallelize a loaded model; meta_init: rank 0 reads the safetensors, the others build on meta
    and receive every tensor (and the rotary buffers) by broadcast; hybrid: 2-D mesh; offload_policy: FSDP2's
    CPUOffloadPolicy; one_unit: no layer is a unit of its own; selective: checkpointing every 2nd layer. Logits,
    parameters, gradients and the grad norm all equal the unsharded model's."""
    _check_against_reference([r[case] for r in two_rank_results], reference)


def test_wrap_policy_leaves_small_layers_in_the_root_unit(two_rank_results, tiny_model_dir):
    """min_num_params above a layer's size: one FSDP unit (the root) instead of one per layer plus the
    root; the case above checks that it trains exactly like the unsharded model."""
    import json
    import os

    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    for r in two_rank_results:
        assert r["shard"][4] == layers + 1
        assert r["one_unit"][4] == 1


def _value_and_offload(path: str):
    import torch.distributed as dist

    from tinyzero.distributed import init_distributed
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.fsdp import (
        load_fsdp_model,
        load_optimizer,
        load_sharded_model,
        make_fsdp_mesh,
        offload_fsdp_model,
        offload_optimizer,
    )

    init_distributed()
    fsdp_cfg = FSDPConfig()
    mesh = make_fsdp_mesh(fsdp_cfg, "cpu")
    model = load_sharded_model(ModelConfig(path=path), fsdp_cfg, mesh, kind="value")
    ids, mask, pos = _batch(seed=3, batch=2)
    values = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    values.sum().backward()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optim.step()
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    state_before = {k: v.clone() for k, v in optim.state[next(iter(model.parameters()))].items()}
    offload_fsdp_model(model)
    offload_optimizer(optim)
    load_fsdp_model(model, "cpu")
    load_optimizer(optim, "cpu")
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    state_after = optim.state[next(iter(model.parameters()))]
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(torch.equal(state_before[k], state_after[k]) for k in state_before)
    all_vals = [None] * dist.get_world_size()
    dist.all_gather_object(all_vals, values.detach())
    return [v.numpy() for v in all_vals]


def test_value_model_sharded(two_rank_results, tiny_model_dir):
    """Critic (backbone + scalar head) built by meta init equals a direct load; offload/load round trips."""
    from tinyzero.models.value import load_value_model

    results = [r["value"] for r in two_rank_results]
    ref = load_value_model(tiny_model_dir)
    ids, mask, pos = _batch(seed=3, batch=2)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    for vals in results:
        for v in vals:  # both ranks ran the same batch
            torch.testing.assert_close(torch.from_numpy(v), expected, **TOL)


def _subset_pool(path: str):
    """World of 3; the model lives on a pool of global ranks {1, 2} (rank 1 is the pool's source)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from tinyzero.distributed import init_distributed
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.fsdp import load_sharded_model

    init_distributed()
    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("fsdp",))
    model = load_sharded_model(ModelConfig(path=path, enable_gradient_checkpointing=False), FSDPConfig(), mesh)
    ids, mask, pos = _batch(seed=4, batch=2)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return logits.numpy()


@pytest.mark.slow
def test_meta_init_on_pool_subset(tiny_model_dir):
    from tinyzero.models.loading import load_causal_lm

    results = run_distributed(_subset_pool, 3, tiny_model_dir)
    ref = load_causal_lm(tiny_model_dir)
    ids, mask, pos = _batch(seed=4, batch=2)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert results[0] is None
    for logits in results[1:]:
        torch.testing.assert_close(torch.from_numpy(logits), expected, **TOL)


def test_checkpointing_recomputes_every_n_th_layer(two_rank_results):
    """model.gradient_checkpointing_every_n_layers: layers 0, n, 2n, ... recompute in backward, the others
    keep their activations; 1 recomputes every layer, checkpointing off none."""
    for r in two_rank_results:
        layers = len(r["shard"][5])
        assert layers >= 2
        assert r["shard"][5] == [True] * layers
        assert r["meta_init"][5] == [False] * layers
        assert r["selective"][5] == [i % 2 == 0 for i in range(layers)]
