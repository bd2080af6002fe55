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

Collective timeouts come from reliability.collective_timeout_s as init_distributed() resolved it
(TINYZERO_COLLECTIVE_TIMEOUT_S overrides it; default 1800 s) unless a ResourcePool is given its
own `timeout_s`. The first failure records its rank, so every message names the rank that
failed first. A rank whose collective timed out did not fail itself (a peer never arrived), so
it records no origin: the messages then say which rank waited and that the one that did not
arrive is unknown, unless a real failure is recorded later.

A user error (`ValueError`, which covers ConfigError, or a type the entry point names with
`report_as_user_errors`) travels with a first line carrying its message, so any rank that learns
of it can report the one line that names the failing rank and the fix (`user_error`); the
traceback stays behind it for TINYZERO_DEBUG=1. Any other exception is a bug and keeps its
traceback everywhere.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time
import traceback
from contextlib import contextmanager

import torch.distributed as dist

from tinyzero.distributed import on_cleanup

__all__ = ["RemoteWorkerError", "SPMDDivergenceError", "abort_rank", "collective_timeout_s", "control_store",
           "describe_failure", "is_collective_timeout", "one_line", "record_abort", "read_abort",
           "report_as_user_errors", "guard", "start_watchdog", "timeout_report", "user_error"]

_KEY_PREFIX = "tinyzero/sc/"
_ABORT_KEY = "abort"
_ABORT_RANK_KEY = "abort_rank"


# A user error's first line as it travels between ranks (describe_failure): the failing rank and the
# exception's message on one line.
_USER_LINE = re.compile(r"^\[tinyzero\] user error on rank (\d+): (.*)$", re.MULTILINE)
_user_error_types: tuple[type[BaseException], ...] = (ValueError,)


def report_as_user_errors(*types: type[BaseException]) -> None:
    """Report these exception types (besides ValueError) as a user error: one line, no traceback."""
    global _user_error_types
    _user_error_types = tuple(dict.fromkeys((*_user_error_types, *types)))


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, _user_error_types)


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (its type name when it has none)."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text or type(exc).__name__


def describe_failure(exc: BaseException, header: str, rank: int | None = None) -> str:
    """How a failure travels to the other ranks: `header:` and the traceback, after a first line with
    the one-line message when `exc` is a user error (see `user_error`)."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    text = f"{header}:\n{''.join(traceback.format_exception(exc))}"
    if is_user_error(exc):
        text = f"[tinyzero] user error on rank {rank}: {one_line(exc)}\n{text}"
    return text


def user_error(text: str) -> tuple[int, str] | None:
    """(rank, one-line message) of the user error a failure text carries, or None for a bug."""
    match = _USER_LINE.search(text or "")
    return (int(match.group(1)), match.group(2)) if match else None


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether a collective (or a store wait) gave up waiting for a peer, rather than failing itself:
    torch.distributed's backends raise a RuntimeError saying "Timed out" (gloo) or "timed out" (nccl,
    the store), wait_for_key a TimeoutError."""
    if isinstance(exc, RemoteWorkerError):
        return False
    return isinstance(exc, TimeoutError) or (isinstance(exc, RuntimeError) and "imed out" in str(exc))


def timeout_report(exc: BaseException, rank: int, world_size: int) -> str:
    """One line for a collective that timed out on this rank: the peer that did not arrive caused it,
    not this rank. With two ranks that peer is known; with more, which one is not (the hang watchdog,
    reliability.hang_timeout_s > 0, names it before the timeout would)."""
    others = [r for r in range(world_size) if r != rank]
    who = f"rank {others[0]}" if len(others) == 1 else f"another rank (one of ranks {others}; which one is unknown)"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}tinyzero{os.sep}" in f.filename]
    where = ""
    if frames:
        path = frames[-1].filename.split(f"{os.sep}tinyzero{os.sep}")[-1]
        where = f" in {path}:{frames[-1].lineno} ({frames[-1].name})"
    return (f"[rank {rank}] stopped: a collective{where} timed out after {collective_timeout_s():.0f} s waiting "
            f"for {who}, which did not arrive; this rank did not fail. Set reliability.hang_timeout_s > 0 (the hang "
            "watchdog names a stuck rank and prints its stack), or raise reliability.collective_timeout_s / "
            "TINYZERO_COLLECTIVE_TIMEOUT_S if a step takes longer than that")


class RemoteWorkerError(RuntimeError):
    """A worker method raised on some rank; carries that rank's formatted traceback."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        _state.raised = True

    @property
    def user_error(self) -> tuple[int, str] | None:
        """(failing rank, one-line message) when the remote failure is a user error, else None."""
        return user_error(self.remote_traceback) or user_error(str(self))


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


def record_abort(message: str) -> bool:
    """Publish the first failure of the job (later ones keep the first message). Returns whether
    this rank's failure is the one recorded, the first of the job (True too when there is no store
    to record it in: then no other rank can report it)."""
    store = control_store()
    if store is None:
        return True
    try:
        if store.add("abort_count", 1) == 1:
            store.set(_ABORT_RANK_KEY, str(dist.get_rank()))
            store.set(_ABORT_KEY, message)
            _state.origin = True
            return True
    except Exception:  # noqa: BLE001 - the store may already be gone while the job dies
        return True
    return False


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
                               "(reliability.collective_timeout_s / TINYZERO_COLLECTIVE_TIMEOUT_S); a rank "
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
    """What the abort watchdog prints before it ends this process: who failed first, and its error
    (a user error as its one line, on the failing rank only, unless TINYZERO_DEBUG=1)."""
    rank = dist.get_rank() if dist.is_initialized() else -1
    first = abort_rank()
    user = user_error(message)
    if user is not None and os.environ.get("TINYZERO_DEBUG") != "1":
        return f"[rank {user[0]}] error: {user[1]}\n" if user[0] == rank else ""
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
