"""The SPMD divergence check: every rank must make the same controller calls with the same arguments.

Enabled with TINYZERO_CHECK_SPMD=1. Each rank publishes "<call #n>: <wg>.<method> <args hash>"
in the job's key-value store and waits (bounded by TINYZERO_CHECK_SPMD_TIMEOUT_S, default 120 s)
for every other rank's entry. A rank that entered a different call, passed different arguments,
or never arrived is named in a `SPMDDivergenceError` raised on every rank -- never a silent hang.
It costs a store round trip and a hash of the arguments per call, so it is a debug switch.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist

from tinyzero.single_controller.failure import SPMDDivergenceError, control_store

__all__ = ["spmd_check_enabled", "fingerprint", "check_same_call", "check_delivery", "next_call_seq"]

_call_counter = itertools.count(1)


def next_call_seq() -> int:
    """Number of the next controller call; equal on every rank while ranks stay in step."""
    return next(_call_counter)


def spmd_check_enabled() -> bool:
    return os.environ.get("TINYZERO_CHECK_SPMD", "0") not in ("", "0", "false", "False")


def _feed(h, obj, depth: int = 0) -> None:
    """Feed a deterministic description of obj into hash h (content for data, names for code)."""
    from tinyzero.protocol import DataProto
    from tinyzero.single_controller.future import LazyResult

    if type(obj) is LazyResult:  # identify it by the call that made it; never deliver it here
        h.update(f"L{obj._lz_seq}:{obj._lz_label}".encode())
        return
    if depth > 20:
        h.update(b"<deep>")
        return
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        if obj.dtype == object:
            for x in obj.reshape(-1):
                _feed(h, x, depth + 1)
        else:
            h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, DataProto):
        h.update(b"DataProto")
        _feed(h, dict(obj.batch), depth + 1)
        _feed(h, obj.non_tensor_batch, depth + 1)
        _feed(h, obj.meta_info, depth + 1)
    elif isinstance(obj, dict):
        h.update(b"D")
        for k in sorted(obj, key=repr):
            _feed(h, k, depth + 1)
            _feed(h, obj[k], depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        h.update(type(obj).__name__.encode())
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        for x in items:
            _feed(h, x, depth + 1)
    elif obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        h.update(repr(obj).encode())
    elif callable(obj):
        h.update(f"F{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__name__)}".encode())
    else:
        text = repr(obj)
        # Reprs holding a memory address differ between processes for equal objects.
        h.update((type(obj).__qualname__ if " at 0x" in text else text).encode())


def fingerprint(*objs) -> str:
    h = hashlib.sha1()
    for o in objs:
        _feed(h, o)
    return h.hexdigest()[:16]


def _timeout_s() -> float:
    return float(os.environ.get("TINYZERO_CHECK_SPMD_TIMEOUT_S", "120"))


def check_same_call(seq: int, label: str, args: tuple, kwargs: dict) -> None:
    """Raise SPMDDivergenceError on every rank unless all ranks entered call #seq alike."""
    store = control_store()
    if store is None or dist.get_world_size() == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = f"{label} args={fingerprint(args, kwargs)}"
    store.set(f"spmd/{seq}/{rank}", mine)
    keys = [f"spmd/{seq}/{r}" for r in range(world)]
    deadline = time.monotonic() + _timeout_s()
    sleep_s = 1e-4
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not store.check([keys[r]])]
            raise SPMDDivergenceError(
                f"SPMD divergence at controller call #{seq}: rank {rank} entered {mine!r}, but rank(s) "
                f"{missing} did not make a controller call #{seq} within {_timeout_s():.0f} s "
                "(TINYZERO_CHECK_SPMD_TIMEOUT_S); first divergent rank: " + str(missing[0]), rank=missing[0])
        time.sleep(sleep_s)
        sleep_s = min(2 * sleep_s, 0.01)
    entries = [v.decode() for v in store.multi_get(keys)]
    if seq >= 2:
        try:
            store.delete_key(f"spmd/{seq - 2}/{rank}")  # every rank has read it by now
        except Exception:  # noqa: BLE001 - cleanup only
            pass
    if len(set(entries)) == 1:
        return
    reference, _ = Counter(entries).most_common(1)[0]
    if entries.count(reference) * 2 <= world:  # no majority: rank 0 is the reference
        reference = entries[0]
    bad = [r for r in range(world) if entries[r] != reference]
    lines = "\n".join(f"  rank {r}: {e}" for r, e in enumerate(entries))
    raise SPMDDivergenceError(
        f"SPMD divergence at controller call #{seq}: first divergent rank is {bad[0]} "
        f"(it entered {entries[bad[0]]!r}; the others entered {reference!r}). Every rank must run the "
        f"same driver code on the same data. All ranks:\n{lines}", rank=bad[0])


def check_delivery(seq: int, label: str, ranks: list[int]) -> None:
    """Raise SPMDDivergenceError unless every rank in `ranks` uses the result of call #seq.

    A result of a pool that is not the whole world crosses to the other ranks when it is first
    used; a rank that uses it while another does not (e.g. under `if rank == 0:`) would wait
    forever. With the switch on, that names the ranks that did not follow.
    """
    store = control_store()
    if store is None:
        return
    rank = dist.get_rank()
    store.set(f"deliver/{seq}/{rank}", "1")
    keys = [f"deliver/{seq}/{r}" for r in ranks]
    deadline = time.monotonic() + _timeout_s()
    sleep_s = 1e-4
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
            raise SPMDDivergenceError(
                f"SPMD divergence: rank {rank} used the result of controller call #{seq} ({label}) but rank(s) "
                f"{missing} did not within {_timeout_s():.0f} s (TINYZERO_CHECK_SPMD_TIMEOUT_S); every rank must use "
                "a result at the same point of the driver (no rank-dependent use); first divergent rank: "
                + str(missing[0]), rank=missing[0])
        time.sleep(sleep_s)
        sleep_s = min(2 * sleep_s, 0.01)
