"""Cost of the single-controller layer against the bare collective it wraps (2 CPU gloo ranks).

A DP_COMPUTE_PROTO round trip of a batch of 1024 x 2048 int64 `input_ids` plus three float32
tensors of the same shape (each rank takes its half, the method returns it, the halves are
gathered back on every rank) is timed against a bare `all_gather` of the same halves into
freshly allocated outputs (the layer returns new tensors, so it pays for them too; a variant
reusing preallocated outputs, and one with every all_gather in flight at once as the layer
issues them, are reported beside it). Runs alternate (A B B A ...) and the medians are compared, so load from
other processes on the machine hits both sides alike. A tiny batch measures the fixed per-call
cost (status exchange + metadata).

    python bench/dispatch.py [--rows 1024] [--cols 2048] [--iters 20]

The last line of output is one JSON object; `overhead_ratio` (target <= 1.2) is
median(round trip) / median(bare all_gather); `overhead_ratio_best_of_n` compares the fastest
runs, which is the steadier figure on a machine shared with other work.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _make_worker_cls():
    from tinyzero.single_controller import Dispatch, Worker, register

    class EchoWorker(Worker):
        @register(Dispatch.DP_COMPUTE_PROTO)
        def echo(self, data):
            return data

    return EchoWorker


def _batch(rows: int, cols: int):
    from tinyzero.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    return DataProto.from_dict({
        "input_ids": torch.randint(0, 50_000, (rows, cols), generator=g),
        "old_log_probs": torch.randn(rows, cols, generator=g),
        "advantages": torch.randn(rows, cols, generator=g),
        "response_mask": (torch.rand(rows, cols, generator=g) > 0.1).float(),
    })


def _bare_all_gather(halves: dict, outs: dict | None, world: int, async_op: bool = False) -> dict:
    """all_gather of each tensor; into fresh outputs (as any call returning new tensors must) or reused
    ones; one after the other, or all in flight at once (async_op) as the layer does."""
    outs = outs or {k: torch.empty((world * v.shape[0], *v.shape[1:]), dtype=v.dtype) for k, v in halves.items()}
    works = [dist.all_gather(list(outs[k].view(world, -1).unbind(0)), half.reshape(-1), async_op=async_op)
             for k, half in halves.items()]
    for w in works if async_op else []:
        w.wait()
    return outs


def _rank_main(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from tinyzero.distributed import init_distributed
    from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup

    init_distributed(timeout_s=300)
    wg = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=ClassWithInitArgs(_make_worker_cls()))
    data = _batch(args.rows, args.cols)
    rows = args.rows // world
    halves = {k: v[rank * rows:(rank + 1) * rows].contiguous() for k, v in data.batch.items()}
    outs = {k: torch.empty_like(v) for k, v in data.batch.items()}

    out = wg.echo(data)
    assert all(torch.equal(out.batch[k], data.batch[k]) for k in data.batch), "round trip changed the data"
    fresh = _bare_all_gather(halves, None, world)
    assert all(torch.equal(fresh[k], data.batch[k]) for k in data.batch)

    layer, bare, bare_reused, bare_async = [], [], [], []
    runs = [(lambda: wg.echo(data), layer), (lambda: _bare_all_gather(halves, None, world), bare),
            (lambda: _bare_all_gather(halves, outs, world), bare_reused),
            (lambda: _bare_all_gather(halves, None, world, async_op=True), bare_async)]
    for i in range(args.iters):
        for fn, times in (runs if i % 2 == 0 else runs[::-1]):  # alternate the order too
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)

    tiny = _batch(2 * world, 8)
    tiny_halves = {k: v[rank * 2:(rank + 1) * 2].contiguous() for k, v in tiny.batch.items()}
    tiny_outs = {k: torch.empty_like(v) for k, v in tiny.batch.items()}
    tiny_layer, tiny_bare = [], []
    tiny_runs = [(lambda: wg.echo(tiny), tiny_layer), (lambda: _bare_all_gather(tiny_halves, tiny_outs, world), tiny_bare)]
    for i in range(50):
        for fn, times in (tiny_runs if i % 2 == 0 else tiny_runs[::-1]):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)

    if rank == 0:
        total_bytes = sum(v.numel() * v.element_size() for v in data.batch.values())
        med_layer, med_bare = statistics.median(layer), statistics.median(bare)
        queue.put({
            "bench": "dispatch",
            "world_size": world,
            "batch": f"{args.rows}x{args.cols} int64 + 3 x float32",
            "batch_mb": round(total_bytes / 2**20, 1),
            "iters": args.iters,
            "round_trip_ms_median": round(1e3 * med_layer, 2),
            "bare_all_gather_ms_median": round(1e3 * med_bare, 2),
            "overhead_ratio": round(med_layer / med_bare, 3),
            "overhead_ratio_best_of_n": round(min(layer) / min(bare), 3),
            "bare_all_gather_reused_outputs_ms_median": round(1e3 * statistics.median(bare_reused), 2),
            "overhead_ratio_vs_reused_outputs": round(med_layer / statistics.median(bare_reused), 3),
            "bare_all_gather_async_ms_median": round(1e3 * statistics.median(bare_async), 2),
            "overhead_ratio_vs_async_all_gather": round(med_layer / statistics.median(bare_async), 3),
            "round_trip_gb_s": round(total_bytes / med_layer / 1e9, 2),
            "tiny_call_overhead_us": round(1e6 * (statistics.median(tiny_layer) - statistics.median(tiny_bare)), 1),
            "target_overhead_ratio": 1.2,
        })
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
