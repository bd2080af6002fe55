"""Shared-memory collectives (tinyzero.distributed.shm_comm) on 2 and 3 CPU gloo ranks.

The all-gather and reduce-scatter must equal gloo's (bit for bit: the sum runs in rank order, and a
plain loop in rank order is the reference) for flat tensors of several dtypes, through slots far
smaller than the tensors (many pieces, a ragged last one). An FSDP2 model whose collectives go through
the segment must train exactly like the same model on gloo (gradients and parameters after two AdamW
steps identical), and the segment must really carry them and the weight sync's gathers. A peer that
never arrives makes the other rank raise within the timeout, naming it; one whose process is gone, at
once. Budget: ~40 s.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def _collectives_worker(slot_bytes: int):
    import torch.distributed as dist

    from tinyzero.distributed.shm_comm import ShmComm

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = ShmComm(dist.group.WORLD, slot_bytes)
    g = torch.Generator().manual_seed(100 + rank)
    bad = []
    for dtype, n in ((torch.float32, 1000), (torch.bfloat16, 333), (torch.float64, 7), (torch.uint8, 4097)):
        x = (torch.randn(n, generator=g) * 100).to(dtype)
        want = torch.empty(n * world, dtype=dtype)
        dist.all_gather_into_tensor(want, x)
        got = torch.empty_like(want)
        comm.all_gather_into(got, x)
        if not torch.equal(got, want):
            bad.append(("all_gather", dtype))
        inplace = torch.zeros_like(want)  # FSDP2's layout: the input is this rank's slice of the output
        inplace[rank * n:(rank + 1) * n].copy_(x)
        comm.all_gather_into(inplace, inplace[rank * n:(rank + 1) * n])
        if not torch.equal(inplace, want):
            bad.append(("all_gather in place", dtype))
        if dtype == torch.uint8:
            continue
        full = (torch.randn(n * world, generator=g)).to(dtype)
        everyone = torch.empty(world, n * world, dtype=dtype)
        dist.all_gather_into_tensor(everyone.view(-1), full)
        parts = everyone[:, rank * n:(rank + 1) * n]
        ref = parts[0].clone()
        for k in range(1, world):  # a plain loop, rank order
            ref = ref + parts[k]
        for average in (False, True):
            out = torch.empty(n, dtype=dtype)
            comm.reduce_scatter_into(out, full, average=average)
            expect = ref / world if average else ref
            if not torch.equal(out, expect):
                bad.append(("reduce_scatter", dtype, average, float((out.double() - expect.double()).abs().max())))
        if world == 2 and dtype == torch.float32:  # gloo itself agrees (a + b == b + a)
            out, gloo = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            comm.reduce_scatter_into(out, full)
            dist.reduce_scatter_tensor(gloo, full)
            if not torch.equal(out, gloo):
                bad.append(("reduce_scatter vs gloo", dtype))
    return bad, comm._seq


@pytest.mark.slow
@pytest.mark.parametrize("world,slot_bytes", [(2, 256), (3, 192), (2, 1 << 20)])
def test_all_gather_and_reduce_scatter_equal_gloo(world, slot_bytes):
    for bad, exchanges in run_distributed(_collectives_worker, world, slot_bytes, timeout=120):
        assert bad == []
        assert exchanges > 8


def _fsdp_worker():
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from tinyzero.distributed.full_params import iter_full_params
    from tinyzero.distributed.shm_comm import use_shm_collectives

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results, calls = {}, {}
    for kind in ("gloo", "shm"):
        torch.manual_seed(0)  # the same model and data for both
        model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 30), nn.Tanh(), nn.Linear(30, 5))
        for layer in model[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        comm = None
        if kind == "shm":
            comm = use_shm_collectives([m for m in model.modules() if isinstance(m, FSDPModule)], mesh.get_group(0),
                                       torch.device("cpu"), timeout_s=60, slot_bytes=512)
            assert comm is not None
            for call in ("all_gather_into", "reduce_scatter_into"):  # count what really goes through the segment
                calls[call] = 0
                setattr(comm, call, _counted(getattr(comm, call), calls, call))
        init = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        grads = []
        for _ in range(2):
            x = torch.randn(6, 24, generator=g)
            loss = model(x).square().mean()
            loss.backward()
            grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        if kind == "shm":  # the weight sync's bucket gathers take the same segment
            before = calls["all_gather_into"]
            synced = dict(iter_full_params(model, bucket_bytes=1 << 20))
            calls["sync"] = calls["all_gather_into"] - before
            calls["all_gather_into"] = before
            assert synced.keys() == params.keys() and all(torch.equal(synced[n], params[n]) for n in params)
        results[kind] = (grads, params)
    (g_grads, g_params), (s_grads, s_params) = results["gloo"], results["shm"]
    differ = [(step, name) for step in range(2) for name in g_grads[step]
              if not torch.equal(s_grads[step][name], g_grads[step][name])]
    differ += [name for name in g_params if not torch.equal(s_params[name], g_params[name])]
    return differ, calls, min(float((g_params[n] - init[n]).abs().max()) for n in init)


def _counted(fn, counts, key):
    def call(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)
    return call


@pytest.mark.slow
def test_fsdp_trains_the_same_through_shared_memory():
    for differ, calls, least_change in run_distributed(_fsdp_worker, 2, timeout=120):
        assert differ == []
        assert least_change > 1e-3  # every parameter trained
        # per step, each of the 3 linear units is gathered for forward and again for backward, and its
        # gradient reduce-scattered once (the root holds no parameters of its own)
        # and the weight sync gathers its one bucket through the segment too
        assert calls == {"all_gather_into": 2 * 6, "reduce_scatter_into": 2 * 3, "sync": 1}


def _absent_peer_worker(peer_gone: bool):
    import subprocess
    import time

    import torch.distributed as dist

    from tinyzero.distributed.shm_comm import ShmComm

    dist.init_process_group("gloo")
    comm = ShmComm(dist.group.WORLD, 256, timeout_s=600.0 if peer_gone else 2.0, what="test exchange")
    if dist.get_rank() == 1:
        time.sleep(6)  # never takes part
        return "absent"
    if peer_gone:  # as if rank 1 had exited: its pid is one that has ended
        comm._pids[1] = subprocess.Popen(["true"]).pid
        time.sleep(0.5)
    start = time.monotonic()
    try:
        comm.all_gather(torch.ones(4))
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.slow
def test_a_missing_peer_raises_within_the_timeout():
    (message, waited), absent = run_distributed(_absent_peer_worker, 2, False, timeout=60)
    assert absent == "absent"
    assert "test exchange: rank 0 waited 2 s for rank 1" in message and "died or is stuck" in message
    assert waited < 5


@pytest.mark.slow
def test_a_peer_that_exited_raises_at_once():
    (message, waited), _ = run_distributed(_absent_peer_worker, 2, True, timeout=60)
    assert "test exchange: rank 1 of the group (pid" in message and "exited while rank 0 waited" in message
    assert waited < 4  # not the 600 s timeout
