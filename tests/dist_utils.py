"""Run a function on N local gloo ranks from a test, with a bounded wall time.

`run_distributed(fn, world_size, *args)` spawns `world_size` processes, sets the torchrun
environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), calls
`fn(*args)` in each and returns the list of per-rank return values (they must pickle).
`fn` must be a module-level function of an importable module (tests/ is a package).
A rank that raises fails the call with that rank's traceback; a hang fails after `timeout`.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, env, queue):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        out = fn(*args)
        queue.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, env: dict | None = None):
    """Run fn(*args) on `world_size` spawned ranks; return their results ordered by rank."""
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, env, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed run did not finish in {timeout}s; "
                                   f"finished ranks: {sorted(results)}, failed: {sorted(errors)}")
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except _q.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results and r not in errors]
                if dead and queue.empty():
                    time.sleep(0.5)
                    if queue.empty():
                        errors.update({r: f"rank {r} exited with code {procs[r].exitcode}" for r in dead})
                continue
            (results if ok else errors)[rank] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        first = min(errors)
        raise RuntimeError(f"rank {first} failed:\n{errors[first]}")
    return [results[r] for r in range(world_size)]
