"""Failure handling for the SPMD controller: a worker error ends the whole job, loudly and soon.

Three mechanisms, from cheapest to last resort:

1. After every call the pool's ranks exchange a status (ok, or the formatted traceback) in
   the same small collective that carries the result's metadata, so every rank of the pool
   raises `RemoteWorkerError` with the failing rank's traceback.
2. A failing rank also writes its traceback under an "abort" key in the job's key-value store
   (the TCPStore torch.distributed was initialised with). Ranks outside the pool check it
   before they wait for that pool's result, so they raise the same error instead of waiting.
3. A watchdog thread per process polls the abort key. A rank that is stuck where no status
   can reach it (inside a collective of a worker method whose peer died) prints the remote
   traceback and exits after a grace period (TINYZERO_ABORT_GRACE_S, default 10 s), so no
   rank is left hanging.

Collective timeouts come from trainer.collective_timeout_s as init_distributed() resolved it
(TINYZERO_COLLECTIVE_TIMEOUT_S overrides it; default 1800 s) unless a ResourcePool is given its
own `timeout_s`. The first failure records its rank, so every message names the rank that
failed first.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from tinyzero.distributed import on_cleanup

__all__ = ["RemoteWorkerError", "SPMDDivergenceError", "abort_rank", "collective_timeout_s", "control_store",
           "record_abort", "read_abort", "guard", "start_watchdog"]

_KEY_PREFIX = "tinyzero/sc/"
_ABORT_KEY = "abort"
_ABORT_RANK_KEY = "abort_rank"


class RemoteWorkerError(RuntimeError):
    """A worker method raised on some rank; carries that rank's formatted traceback."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        _state.raised = True


class SPMDDivergenceError(RuntimeError):
    """Ranks entered different controller calls (or the same call with different arguments)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
        _state.raised = True


class _State:
    store = None
    store_owner = None  # the default process group the store belongs to
    raised = False
    origin = False  # this rank published the abort
    watchdog: threading.Thread | None = None
    watchdog_stop: threading.Event | None = None


_state = _State()


@on_cleanup
def _release() -> None:
    """Before the groups are destroyed: stop the watchdog (no store call in flight at exit) and drop the
    cached store client and default group."""
    _stop_watchdog()
    _state.store = _state.store_owner = None


def collective_timeout_s() -> float:
    """The job's collective timeout (tinyzero.distributed.collective_timeout_s)."""
    from tinyzero.distributed import collective_timeout_s as resolved

    return resolved()


def abort_grace_s() -> float:
    return float(os.environ.get("TINYZERO_ABORT_GRACE_S", "10"))


def control_store():
    """The job's TCPStore under a private prefix (None when it cannot be reached)."""
    if not dist.is_initialized():
        return None
    group = dist.distributed_c10d._get_default_group()
    if _state.store is None or _state.store_owner is not group:
        try:
            base = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - a store is a convenience, never a requirement
            return None
        _state.store = dist.PrefixStore(_KEY_PREFIX, base)
        _state.store_owner = group
        _state.raised = False
    return _state.store


def record_abort(message: str) -> None:
    """Publish the first failure of the job (later ones keep the first message)."""
    store = control_store()
    if store is None:
        return
    try:
        if store.add("abort_count", 1) == 1:
            store.set(_ABORT_RANK_KEY, str(dist.get_rank()))
            store.set(_ABORT_KEY, message)
            _state.origin = True
    except Exception:  # noqa: BLE001 - the store may already be gone while the job dies
        pass


def _read(key: str) -> str | None:
    """A control-store value, or None when it is unset or the store is gone (the job may be dying)."""
    store = control_store()
    if store is None:
        return None
    try:
        if store.check([key]):
            return store.get(key).decode(errors="replace")
    except Exception:  # noqa: BLE001 - the store may already be gone while the job dies
        return None
    return None


def abort_rank() -> int | None:
    """The global rank that recorded the job's first failure (None when none did, or unknown)."""
    value = _read(_ABORT_RANK_KEY)
    return int(value) if value is not None else None


def _first_failed() -> str:
    first = abort_rank()
    return f"rank {first}" if first is not None else "another rank"


def read_abort() -> str | None:
    """The first failure's message, once one was recorded."""
    return _read(_ABORT_KEY)


def wait_for_key(key: str, timeout_s: float, what: str) -> bytes:
    """Wait for `key` in the control store; raise RemoteWorkerError as soon as an abort is recorded."""
    store = control_store()
    deadline = time.monotonic() + timeout_s
    sleep_s, last_abort_check = 1e-4, time.monotonic()
    while True:
        # Polling with backoff: store.wait() with a short timeout logs a warning on every expiry.
        if store.check([key]):
            return store.get(key)
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"rank {dist.get_rank()}: no answer for {what} after {timeout_s:.0f} s "
                               "(trainer.collective_timeout_s / TINYZERO_COLLECTIVE_TIMEOUT_S); a rank "
                               "stopped participating")
        if now - last_abort_check > 0.5:
            last_abort_check = now
            aborted = read_abort()
            if aborted is not None:
                raise RemoteWorkerError(f"rank {dist.get_rank()} gave up waiting for {what} because "
                                        f"{_first_failed()} failed: {aborted}",
                                        remote_traceback=aborted)
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, 0.01)


@contextmanager
def guard(what: str):
    """Turn a collective that failed because a peer died into the peer's own error when known."""
    try:
        yield
    except (RemoteWorkerError, SPMDDivergenceError):
        raise
    except Exception as e:
        time.sleep(0.2)  # let the failing rank publish its traceback
        aborted = read_abort()
        rank = dist.get_rank() if dist.is_initialized() else 0
        if aborted is not None:
            raise RemoteWorkerError(f"rank {rank}: {what} failed after {_first_failed()} failed: {aborted}",
                                    remote_traceback=aborted) from e
        raise


def _watch(poll_s: float, stop: threading.Event) -> None:
    seen_at = None
    while not stop.wait(poll_s):
        if not dist.is_initialized():  # the job tore its process group down: nothing left to guard
            return
        try:
            message = read_abort()
        except Exception:  # noqa: BLE001 - the job is being torn down
            return
        if message is None or _state.raised:
            seen_at = None
            continue
        seen_at = seen_at or time.monotonic()
        # The failing rank goes first: its exit breaks its peers' pending collectives, which
        # then raise RemoteWorkerError with its traceback instead of being killed.
        grace = abort_grace_s() * (1 if _state.origin else 2)
        if time.monotonic() - seen_at >= grace:
            sys.stderr.write(_exit_message(message))
            sys.stderr.flush()
            os._exit(1)


def _exit_message(message: str) -> str:
    """What the abort watchdog prints before it ends this process: who failed first, and its error."""
    rank = dist.get_rank() if dist.is_initialized() else -1
    first = abort_rank()
    if _state.origin or first == rank:
        return (f"[tinyzero] rank {rank}: exiting after its own failure (the first of the job); its peers "
                f"could not be told in time:\n{message}\n")
    return (f"[tinyzero] rank {rank}: exiting because {_first_failed()} failed first and this rank could not be told "
            f"in time:\n{message}\n")


def _stop_watchdog() -> None:
    """Stop the watchdog before interpreter teardown (a store call racing teardown aborts the process)."""
    thread, stop = _state.watchdog, _state.watchdog_stop
    if thread is not None and stop is not None:
        stop.set()
        thread.join(timeout=5)
    _state.watchdog = None


def start_watchdog(poll_s: float = 0.5) -> None:
    """Start the per-process abort watchdog once (only useful with more than one rank)."""
    if _state.watchdog is not None and _state.watchdog.is_alive():
        return
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if os.environ.get("TINYZERO_ABORT_WATCHDOG", "1") == "0":
        return
    if _state.watchdog_stop is None:
        atexit.register(_stop_watchdog)
    _state.watchdog_stop = threading.Event()
    _state.watchdog = threading.Thread(target=_watch, args=(poll_s, _state.watchdog_stop),
                                       name="tinyzero-abort-watchdog", daemon=True)
    _state.watchdog.start()
