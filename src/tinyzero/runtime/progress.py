"""Progress reports and the hang watchdog: a rank that stops making progress is named within a bound.

Every rank calls `report_progress(phase, **detail)` as it works: the trainer per step and
phase, the update loop per micro-batch, the native generator per decoded token, reward scoring
per scored sample. A report only stores a tuple (no I/O, about a microsecond), so it may sit in
inner loops. This module imports nothing of tinyzero, so any layer may call it.

`start_watchdog(hang_timeout_s)` (train.py passes reliability.hang_timeout_s) starts a daemon
thread per rank. Every hang_timeout_s / 5 seconds (at most 5 s) it publishes the rank's
heartbeat in the job's TCPStore, over a connection of its own (a main thread blocked in a
collective or a store wait cannot block it): seconds since the last report, the report, where
the main thread is now (file:line) and whether that is inside a collective (torch.distributed or
the controller's own waits). From every heartbeat each rank applies the same rule:

- a rank whose heartbeat stops changing for hang_timeout_s is frozen (SIGSTOP, a debugger, a
  native call holding the GIL, a lost host);
- a rank with no progress for hang_timeout_s, whose main thread stayed at the same place (its
  innermost frames did not move: a wait, a sleep, a native call) and not inside a collective, is
  stuck (the peers that wait for it in a collective are not blamed; a thread still running Python
  code, such as a generation engine's loop that reports nothing, is busy, not stuck);
- on a GPU a collective returns at once and the rank waits later, at the next host sync (`.item()`,
  a copy to the CPU) anywhere in the code: a main thread that sits still while its GPU stream still
  has queued work (a collective waiting for a peer, or a long kernel) waits for its GPU, and counts
  as waiting, not stuck (only a GPU can exercise this check: `_gpu_pending`);
- when every rank waits in a collective with no progress (one that some rank never joined), the
  rank that stopped progressing first is named.

Start-up (from start_watchdog() to the first report: model loading, engine start) is not
watched for progress, only for frozen ranks; the collective timeout bounds it.

The first rank to decide publishes the verdict. Every live rank then dumps its Python stacks
(faulthandler, all threads) to stderr; the deciding rank prints one message naming the stuck
rank, its phase and its last progress, kills frozen ranks on its host (SIGKILL: a stopped
process cannot act and would hold torchrun's teardown for 30 s), and every rank exits with
HANG_EXIT_CODE. Without a store (a single process) the watchdog watches its own rank.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import NamedTuple

__all__ = ["HANG_EXIT_CODE", "report_progress", "start_watchdog", "stop_watchdog"]

HANG_EXIT_CODE = 4
"""Exit code of every rank of a job the watchdog ended."""

_KEY_PREFIX = "tinyzero/progress/"
# Innermost main-thread frames in these files mean "waiting for other ranks", not "stuck".
_WAIT_MARKERS = tuple(os.path.join(*parts) for parts in (
    ("torch", "distributed", ""),
    ("tinyzero", "single_controller", "failure.py"),
    ("tinyzero", "single_controller", "future.py"),
    ("tinyzero", "single_controller", "transport.py"),
))


class _Report(NamedTuple):
    at: float  # time.monotonic() of the report
    phase: str
    detail: dict


_STARTUP = "startup"
_last = _Report(time.monotonic(), _STARTUP, {})
_step: object = None  # the step of the last report that named one
_recent: deque = deque(maxlen=6)  # the last distinct phases, oldest first


def report_progress(phase: str, **detail) -> None:
    """Record that this rank made progress in `phase` (detail: small counters, e.g. step=3, token=17)."""
    global _last, _step
    if phase != _last.phase:
        _recent.append(_last.phase)
    _last = _Report(time.monotonic(), phase, detail)
    if "step" in detail:
        _step = detail["step"]


def _describe(phase: str, detail: str) -> str:
    return f"{phase} ({detail})" if detail else phase


def _main_thread_at() -> tuple[str, bool, tuple]:
    """The main thread's innermost Python frame as "file:line in function", whether it waits for
    peers, and a signature of its innermost frames (it changes while the thread runs Python code)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown", False, ()
    filename = frame.f_code.co_filename
    waiting = any(marker in filename for marker in _WAIT_MARKERS)
    short = os.sep.join(filename.split(os.sep)[-3:])
    signature, f = [], frame
    while f is not None and len(signature) < 4:
        signature.append((id(f), f.f_lasti))
        f = f.f_back
    return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}", waiting, tuple(signature)


class _Watchdog:
    """The per-rank thread (see the module docstring)."""

    def __init__(self, bound_s: float, poll_s: float, store, rank: int, world: int, gpu: int | None = None):
        self.bound_s, self.poll_s = bound_s, poll_s
        self.gpu = gpu  # the main thread's CUDA device (its streams are queried), None on CPU
        self.store, self.rank, self.world = store, rank, world
        self.beat = 0
        self.seen: dict[int, tuple[object, float]] = {}  # rank -> (its beat, when it last changed here)
        self.signature: tuple = ()  # the main thread's innermost frames at the last heartbeat
        self.moved_at = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tinyzero-hang-watchdog", daemon=True)

    # ------------------------------------------------------------------ heartbeats
    def status(self, done: bool = False) -> dict:
        last, now = _last, time.monotonic()
        where, waiting, signature = _main_thread_at()
        gpu_wait = not waiting and _gpu_pending(self.gpu)
        if signature != self.signature:
            self.signature, self.moved_at = signature, now
        detail = ", ".join(f"{k}={v}" for k, v in last.detail.items())
        return {"beat": self.beat, "age": now - last.at, "still": now - self.moved_at, "phase": last.phase,
                "detail": detail, "step": _step, "recent": list(_recent), "where": where, "waiting": waiting,
                "gpu_wait": gpu_wait, "host": socket.gethostname(), "pid": os.getpid(), "done": done}

    def publish(self, status: dict) -> None:
        if self.store is not None:
            self.store.set(f"hb/{self.rank}", json.dumps(status))

    def statuses(self, mine: dict) -> dict[int, dict | None]:
        out: dict[int, dict | None] = {self.rank: mine}
        if self.store is None:
            return out
        others = [r for r in range(self.world) if r != self.rank]
        present = [r for r in others if self.store.check([f"hb/{r}"])]
        values = self.store.multi_get([f"hb/{r}" for r in present]) if present else []
        for r in others:
            out[r] = None
        for r, raw in zip(present, values):
            out[r] = json.loads(bytes(raw).decode())
        return out

    # ------------------------------------------------------------------ the rule
    def decide(self, statuses: dict[int, dict | None], now: float) -> str | None:
        """The verdict message when some rank is frozen or stuck, else None."""
        frozen, live = [], {}
        for r in range(self.world):
            st = statuses.get(r)
            key = None if st is None else st["beat"]
            if r not in self.seen or self.seen[r][0] != key:
                self.seen[r] = (key, now)
            if st is not None and st["done"]:
                continue
            if r != self.rank and now - self.seen[r][1] > self.bound_s:
                frozen.append(r)
            elif st is not None:
                live[r] = st
        # Start-up (model loading, engine start) reports nothing: it is bounded by the collective timeout.
        # A main thread still running Python code (a generation engine's loop that reports nothing) is
        # busy, not stuck: only one whose innermost frames did not move is.
        stale = {r: st for r, st in live.items()
                 if min(st["age"], st["still"]) > self.bound_s and st["phase"] != _STARTUP}
        stuck = [r for r, st in stale.items() if not _waits(st)]
        if not frozen and not stuck:
            if not live or len(stale) < len(live):
                return None
            stuck = [max(live, key=lambda r: live[r]["age"])]  # every rank waits: a collective nobody completes
        return self._message(frozen, stuck, statuses, live, now)

    def _message(self, frozen, stuck, statuses, live, now) -> str:
        lines = []
        for r in frozen:
            st = statuses.get(r)
            silent = now - self.seen[r][1]
            if st is None:
                lines.append(f"rank {r} never sent a heartbeat in {silent:.1f} s (it did not start, or froze early)")
                continue
            lines.append(f"rank {r} stopped responding: no heartbeat for {silent:.1f} s (the process is frozen: "
                         f"SIGSTOP, a debugger, native code holding the GIL, or its host is gone); "
                         f"{_last_seen(st)}")
        every_waits = stuck and all(_waits(live[r]) for r in stuck)
        for r in stuck:
            st = live[r]
            why = ("every rank waits in a collective that one of them never joined; this rank stopped progressing "
                   "first" if every_waits else f"its main thread has not moved for {st['still']:.1f} s and it is "
                   "not waiting for other ranks")
            lines.append(f"rank {r} made no progress for {st['age']:.1f} s ({why}); {_last_seen(st)}")
        named = set(frozen) | set(stuck)
        others = [f"rank {r}: {_state(st)} at {st['where']}, last "
                  f"progress {_describe(st['phase'], st['detail'])} {st['age']:.1f} s ago"
                  for r, st in sorted(live.items()) if r not in named]
        head = f"[tinyzero] hang: no progress within reliability.hang_timeout_s={self.bound_s:g} s on rank(s) " + \
            ", ".join(str(r) for r in sorted(named))
        body = "\n  ".join(lines + (["the other ranks:", *others] if others else []))
        return (f"{head}\n  {body}\n  The Python stacks of every live rank are above. If this phase is legitimately "
                "this slow, raise --reliability.hang_timeout_s (0 disables the watchdog).")

    # ------------------------------------------------------------------ the end
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - the watchdog must never take a healthy job down
            if not self.stop.is_set():
                print(f"[tinyzero] rank {self.rank}: hang watchdog stopped ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)

    def _loop(self) -> None:
        while not self.stop.wait(self.poll_s):
            self.beat += 1
            mine = self.status()
            self.publish(mine)
            if self.store is not None and self.store.check(["hang"]):
                self._end(self.store.get("hang").decode(errors="replace"), reporter=False, statuses={})
            statuses = self.statuses(mine)
            verdict = self.decide(statuses, time.monotonic())
            if verdict is None or self.stop.is_set():
                continue
            if self.store is None or self.store.add("hang_count", 1) == 1:
                if self.store is not None:
                    self.store.set("hang", verdict)
                self._end(verdict, reporter=True, statuses=statuses)
            else:
                self._end(self._wait_key("hang", 10.0) or verdict, reporter=False, statuses={})

    def _wait_key(self, key: str, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.store.check([key]):
                return self.store.get(key).decode(errors="replace")
            time.sleep(0.05)
        return None

    def _end(self, verdict: str, reporter: bool, statuses: dict) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"[tinyzero] rank {self.rank}: Python stacks at the hang (reliability.hang_timeout_s):\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        if self.store is None:
            sys.stderr.write(verdict + "\n")
            sys.stderr.flush()
            os._exit(HANG_EXIT_CODE)
        self.store.set(f"dumped/{self.rank}", "1")
        if not reporter:
            self._wait_key("reported", 10.0)
            self.store.set(f"exiting/{self.rank}", "1")
            os._exit(HANG_EXIT_CODE)
        live = [r for r, st in statuses.items() if st is not None and not st["done"] and r != self.rank
                and r in self.seen and time.monotonic() - self.seen[r][1] <= self.bound_s]
        self._wait_all(live, "dumped", 2 * self.poll_s + 2.0)
        sys.stderr.write(verdict + "\n")
        sys.stderr.flush()
        self.store.set("reported", "1")
        # The peers exit first: this rank's exit makes torchrun stop (SIGTERM) whoever is left.
        self._wait_all(live, "exiting", 2.0)
        time.sleep(0.1)
        self._kill_frozen(statuses, live)
        os._exit(HANG_EXIT_CODE)

    def _wait_all(self, ranks: list[int], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(self.store.check([f"{what}/{r}"]) for r in ranks):
            time.sleep(0.05)

    def _kill_frozen(self, statuses: dict, live: list[int]) -> None:
        host = socket.gethostname()
        for r, st in statuses.items():
            if st is None or r == self.rank or r in live or st["done"] or st["host"] != host:
                continue
            try:
                os.kill(int(st["pid"]), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def _waits(st: dict) -> bool:
    """Whether a rank's main thread waits for its peers: in a collective, or for its GPU's queued work."""
    return bool(st["waiting"] or st.get("gpu_wait"))


def _state(st: dict) -> str:
    if st["waiting"]:
        return "waits in a collective"
    return "waits for its GPU (queued work: a collective or a kernel)" if st.get("gpu_wait") else "busy"


def _gpu_pending(device: int | None) -> bool:
    """Whether the CUDA device's current stream (the default one, as the main thread's) has queued work
    that has not finished: a non-blocking query, safe from this thread while the main thread is blocked in
    a host sync. False on CPU and on any error (the watchdog must not fail on it)."""
    if device is None:
        return False
    torch = sys.modules.get("torch")
    try:
        with torch.cuda.device(device):
            return not torch.cuda.current_stream(device).query()
    except Exception:  # noqa: BLE001 - a watchdog query, never a reason to fail
        return False


def _main_gpu() -> int | None:
    """The CUDA device the main thread works on (call from the main thread), None without CUDA."""
    torch = sys.modules.get("torch")
    try:
        return torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None


def _last_seen(st: dict) -> str:
    step = f" in step {st['step']}" if st.get("step") is not None else ""
    before = f", after {' -> '.join(st['recent'][-4:])}" if st.get("recent") else ""
    return (f"last progress{step}: {_describe(st['phase'], st['detail'])}, {st['age']:.1f} s before its last "
            f"heartbeat{before}; main thread at {st['where']}")


_watchdog: _Watchdog | None = None


def _own_store():
    """A private connection to the job's store, under this module's prefix (None without one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from datetime import timedelta

    base = dist.distributed_c10d._get_default_store()
    try:
        base = base.clone()  # its own socket: a main thread blocked in a store wait holds the shared one
        # Every call of the watchdog is a short set / check / get; one that does not return within this
        # bound (the store's host is gone) fails, so stop_watchdog()'s join is bounded too.
        base.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - older stores cannot clone; sharing only delays heartbeats
        pass
    return dist.PrefixStore(_KEY_PREFIX, base)


def start_watchdog(hang_timeout_s: float) -> None:
    """Start this rank's hang watchdog (after init_distributed; once per process). 0 disables it."""
    global _watchdog
    if hang_timeout_s <= 0 or (_watchdog is not None and _watchdog.thread.is_alive()):
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    store = _own_store()
    if store is None:
        world = 1  # nothing to see of the other ranks: watch this one
    report_progress(_STARTUP)
    _watchdog = _Watchdog(float(hang_timeout_s), min(max(hang_timeout_s / 5.0, 0.1), 5.0), store, rank, world,
                          gpu=_main_gpu())
    _watchdog.thread.start()
    atexit.register(stop_watchdog)


STORE_TIMEOUT_S = 30.0
"""Timeout of each call on the watchdog's own store connection."""
STOP_TIMEOUT_S = 10.0
"""How long stop_watchdog() waits for the thread to finish its current heartbeat (a few store calls)."""


def stop_watchdog() -> None:
    """Stop the watchdog, tell the other ranks this one is done, and close its store connection (safe to
    call twice). Call it before the process group is destroyed (train.py's teardown does).

    The thread is joined, not abandoned: a daemon thread still inside a store call (which releases the
    GIL) when the interpreter finalizes cannot take the GIL back, and CPython's pthread_exit of that
    thread aborts the whole process ("terminate called without an active exception") after a run that
    succeeded. Its connection is closed here, by this thread, once no call can be in flight on it.
    """
    global _watchdog
    wd, _watchdog = _watchdog, None
    if wd is None:
        return
    wd.stop.set()
    wd.thread.join(timeout=STOP_TIMEOUT_S)
    if wd.thread.is_alive():  # a store call that does not return: its connection's timeout (STORE_TIMEOUT_S) ends it
        print(f"[tinyzero] rank {wd.rank}: the hang watchdog did not stop within {STOP_TIMEOUT_S:g} s (a store "
              "call is not returning); waiting for it so that it cannot outlive the interpreter",
              file=sys.stderr, flush=True)
        wd.thread.join()
    try:
        wd.publish(wd.status(done=True))
    except Exception:  # noqa: BLE001 - the store may already be gone at exit
        pass
    wd.store = None  # the last reference to its own TCPStore client: the connection closes now
