"""Split placement overlap: two worker groups on disjoint pools (the critic's and the policy's), each
running an update of the same cost, called the way the PPO loop calls them (trainer/ppo.py
update_models: both calls, then both results read) against reading each result before the next
call (the loop before the change). 2 x `--pool` CPU gloo ranks; the work is `--work_s` seconds of
float32 matmuls per call. Runs alternate (A B B A ...) and medians are compared.

    python bench/split_overlap.py [--pool 1] [--work_s 0.5] [--iters 6]

The last line is one JSON object: serial_s and overlapped_s are the medians of one step's two updates
as rank 0 sees them; speedup = serial_s / overlapped_s (2.0 when the pools overlap perfectly and the
machine has a core per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp


def _make_worker_cls():
    from tinyzero.protocol import DataProto
    from tinyzero.single_controller import Dispatch, Worker, register

    class BusyWorker(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def update(self, seconds: float) -> DataProto:
            a = torch.randn(256, 256)
            end = time.perf_counter() + seconds
            n = 0
            while time.perf_counter() < end:
                a = torch.tanh(a @ a)
                n += 1
            return DataProto(meta_info={"metrics": {"iters": float(n)}})

    return BusyWorker


def _rank_main(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from tinyzero.distributed import init_distributed
    from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from tinyzero.single_controller.future import materialize

    init_distributed(timeout_s=300)
    cls = ClassWithInitArgs(_make_worker_cls())
    policy = WorkerGroup(resource_pool=ResourcePool(ranks=list(range(args.pool))), cls_with_init=cls)
    critic = WorkerGroup(resource_pool=ResourcePool(ranks=list(range(args.pool, world))), cls_with_init=cls)

    def serial() -> None:
        materialize(critic.update(args.work_s))
        materialize(policy.update(args.work_s))

    def overlapped() -> None:
        c, p = critic.update(args.work_s), policy.update(args.work_s)
        materialize(c)
        materialize(p)

    times = {"serial": [], "overlapped": []}
    overlapped()  # warm-up
    for i in range(args.iters):
        order = ("serial", "overlapped") if i % 2 == 0 else ("overlapped", "serial")
        for name in order:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            (serial if name == "serial" else overlapped)()
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        s, o = statistics.median(times["serial"]), statistics.median(times["overlapped"])
        queue.put({"pool_size": args.pool, "work_s": args.work_s, "serial_s": round(s, 4),
                   "overlapped_s": round(o, 4), "speedup": round(s / o, 3)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=1, help="ranks per pool")
    parser.add_argument("--work_s", type=float, default=0.5, help="seconds of work per update call")
    parser.add_argument("--iters", type=int, default=6)
    args = parser.parse_args()
    world = 2 * args.pool
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
