"""Process-group setup from the torchrun environment, device choice and seeding.

Under `torchrun --nproc_per_node N train.py ...` every process reads RANK / WORLD_SIZE /
LOCAL_RANK from the environment; under plain `python train.py` the program runs as a single
process group of one (gloo on CPU, nccl on CUDA), so the same code path is used everywhere.
This module is the only place that reads those variables.
"""

from __future__ import annotations

import datetime
import gc
import os
import random
import sys
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "check_one_gpu_per_rank",
    "init_distributed",
    "is_distributed",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "spans_nodes",
    "get_device",
    "device_type",
    "backend_for_device",
    "barrier",
    "cleanup",
    "on_cleanup",
    "collective_timeout_s",
    "resolve_collective_timeout_s",
    "set_seed",
]


def device_type() -> str:
    """"cuda" when a GPU is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for_device(kind: str | None = None) -> str:
    """nccl on CUDA, gloo elsewhere."""
    return "nccl" if (kind or device_type()) == "cuda" else "gloo"


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_device() -> torch.device:
    """One device per local rank: cuda:LOCAL_RANK on GPU machines, cpu otherwise."""
    if device_type() == "cuda":
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0
TIMEOUT_ENV = "TINYZERO_COLLECTIVE_TIMEOUT_S"
_collective_timeout_s: float | None = None  # what init_distributed() resolved, for the groups made later


def resolve_collective_timeout_s(timeout_s: float | None = None) -> float:
    """The collective timeout to use: TINYZERO_COLLECTIVE_TIMEOUT_S if set, else `timeout_s`, else 1800 s."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; unset it or give e.g. 600") from None
        if not 0 < value < float("inf"):  # NaN and inf too: a timedelta cannot hold them
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a finite number of seconds > 0; unset it or give "
                             "e.g. 600")
        return value
    return DEFAULT_COLLECTIVE_TIMEOUT_S if timeout_s is None else float(timeout_s)


def collective_timeout_s() -> float:
    """The timeout of every process group of the job (the world group and every pool's groups).

    The value init_distributed() resolved (reliability.collective_timeout_s, or the environment
    variable TINYZERO_COLLECTIVE_TIMEOUT_S, which overrides it); before that, the same resolution.
    """
    return _collective_timeout_s if _collective_timeout_s is not None else resolve_collective_timeout_s()


def check_one_gpu_per_rank(local_world_size: int, visible_gpus: int) -> None:
    """Each rank of a node drives its own GPU (cuda:LOCAL_RANK): more ranks than visible GPUs would put two
    ranks on one device, where FSDP2, NCCL and the engines fail later with errors that do not say why."""
    if local_world_size > visible_gpus:
        raise ValueError(f"{local_world_size} ranks on this node but {visible_gpus} GPU(s) visible: each rank "
                         f"needs a GPU of its own; start torchrun with --nproc_per_node {visible_gpus} (or at "
                         "most the GPUs in CUDA_VISIBLE_DEVICES), or run on the CPU with trainer.device=cpu")


def init_distributed(timeout_s: float | None = None) -> None:
    """Initialise the default process group from torchrun's environment, or as a group of one.

    `timeout_s` (train.py passes reliability.collective_timeout_s; the environment variable
    TINYZERO_COLLECTIVE_TIMEOUT_S overrides it; default 1800 s) bounds every collective of the
    world group and of the groups made later (resource pools, mesh axes): a rank that stops
    participating makes the others fail after this long instead of hanging forever.
    """
    global _collective_timeout_s
    if dist.is_initialized():
        return
    timeout_s = resolve_collective_timeout_s(timeout_s)
    if "RANK" not in os.environ:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    kind = device_type()
    if kind == "cuda":
        check_one_gpu_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
        torch.cuda.set_device(get_device())
    # gloo for CPU tensors everywhere; on GPU nccl handles cuda tensors and gloo the CPU ones
    # (object collectives, CPU state), as torchtitan does.
    backend = "cuda:nccl,cpu:gloo" if kind == "cuda" else "gloo"
    _collective_timeout_s = timeout_s
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _restarted_attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def _restarted_attempt_store(timeout: datetime.timedelta):
    """Under `torchrun --max-restarts`, a store namespace of its own for a restarted attempt (else None).

    torchrun keeps one rendezvous TCPStore for the whole job, and process-group keys are named by a
    per-process counter, so a restarted attempt would read the previous attempt's (dead) gloo
    addresses and fail with "Connection refused". Prefixing the store with the restart count keeps
    every attempt's keys apart.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_hosts_store and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"tinyzero/attempt_{restart}/", store)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", "0"))


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else int(os.environ.get("WORLD_SIZE", "1"))


def spans_nodes() -> bool:
    """Whether the job runs on more than one node: torchrun's LOCAL_WORLD_SIZE (ranks on this node) is
    below the world size. A launcher that does not set LOCAL_WORLD_SIZE counts as several nodes."""
    world = get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return world > 1 and (local <= 0 or local < world)


def barrier(group=None) -> None:
    if is_distributed():
        dist.barrier(group=group)


_cleanup_hooks: list[Callable[[], None]] = []


def on_cleanup(hook: Callable[[], None]) -> Callable[[], None]:
    """Have cleanup() call `hook` (once per registration, newest first) before it destroys the groups:
    stop a thread that uses the store or a group, drop a cache that holds groups or store clients."""
    if hook not in _cleanup_hooks:
        _cleanup_hooks.append(hook)
    return hook


def cleanup() -> None:
    """Tear torch.distributed down so that no thread of it outlives this call (safe to call twice).

    The on_cleanup hooks run first (threads that call the store stop; caches drop the groups they
    hold), then every process group is destroyed and garbage is collected, so each gloo group's
    worker and transport threads are joined here, while the interpreter is alive. Left to
    interpreter exit, a group held by a module cache or a reference cycle is torn down during
    finalization, and a thread that is inside a torch call with the GIL released when finalization
    starts (a daemon thread in a store call, a group freed by a garbage collection that ran on
    another thread) cannot take the GIL back: CPython ends the thread with pthread_exit, whose
    unwinding through a noexcept C++ frame aborts the process ("terminate called without an active
    exception", SIGABRT) after the work is done.
    """
    for hook in reversed(_cleanup_hooks):
        try:
            hook()
        except Exception as e:  # noqa: BLE001 - teardown must not mask the original error
            print(f"[tinyzero] rank {get_rank()}: teardown step {getattr(hook, '__qualname__', hook)} failed: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
    _drop_dtensor_caches()
    if is_distributed():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown must not mask the original error
            pass
    gc.collect()  # groups still referenced from cycles (workers, meshes) are freed, and their threads joined, now


def _drop_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation caches (checked on torch 2.13): a C++ thread-local map and a
    Python LRU keep every DTensorSpec they saw, so its DeviceMesh and the mesh's process group, alive
    until the interpreter clears the torch module at exit (FSDP2's world group outlives cleanup())."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    from torch.distributed.tensor import DTensor

    python_cache = getattr(getattr(DTensor._op_dispatcher, "sharding_propagator", None), "propagate_op_sharding", None)
    if hasattr(python_cache, "cache_clear"):
        python_cache.cache_clear()


def set_seed(seed: int, rank_offset: bool = False) -> None:
    """Seed python, numpy and torch (all devices); with rank_offset each rank gets seed + rank."""
    if rank_offset:
        seed = seed + get_rank()
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
