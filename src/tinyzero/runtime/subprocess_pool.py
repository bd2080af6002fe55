"""A pool of killable worker subprocesses that answer pickled messages over pipes.

The reward scoring pool (tinyzero.rewards.scoring) and the agent's tool pool (tinyzero.agent.pool)
both run code they do not trust to return: a user's reward function, a model's tool call. Both are
built on this module.

    pool = SubprocessPool("tinyzero.rewards.scoring_worker", settings, num_workers=4,
                          name="a reward scoring worker", loads="its scorer")
    outcomes = pool.run(messages, limits_s=[2.0] * len(messages))   # one Outcome per message, in order
    pool.close()

A worker is `python -m <module>`: its `main()` calls `serve(setup)`, which reads the pool's settings
once, calls `setup(settings)` to load what it needs, answers None (ready) or the load error, then
answers each message with `handle(message)`. Messages both ways are length-prefixed pickles
(`write_message`, `read_message`); the parent is a worker's only peer.

What the pool guarantees:
- Every message gets an `Outcome`: a worker still busy `kill_grace_s` past its message's limit is
  killed (SIGKILL, which nothing in it can catch or ignore) and the outcome is "timeout"; a worker
  that dies (a crash, a signal, the memory limit) gives "died" with its exit code; past the batch
  budget every busy worker is killed ("in_flight") and the rest are "not_started". With a limit on
  every message (or a budget), nothing a worker does can hang the caller.
- A worker that does not answer its settings within `ready_timeout_s` is killed and the call raises
  TimeoutError; one whose setup failed raises ValueError with its error.
- A killed or dead worker is replaced by a fresh one before its slot takes the next message; the
  batch goes on.
- A worker answers one message at a time, so a readable pipe means that message's answer.
- Start-up (imports, loading a user module) is charged to no message's limit and not to the budget.

Why a plain subprocess and not multiprocessing: forking the trainer (CUDA, NCCL, threads) is unsafe,
and under spawn every worker re-imports the trainer's main script; a multiprocessing.Pool whose
worker is killed never returns that task, so a hung task cannot be stopped without losing the pool.
`python -m module` over two pipes starts a clean interpreter that imports only what the worker
needs, and killing it costs one worker.
"""

from __future__ import annotations

import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["write_message", "read_message", "serve", "Worker", "Outcome", "SubprocessPool"]

_HEADER = struct.Struct("<Q")


def write_message(stream, obj) -> None:
    """Length-prefixed pickle on a binary stream (parent <-> its own worker only)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_message(stream):
    """The next length-prefixed pickle from a binary stream; EOFError when the peer is gone."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the worker closed its pipe")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the worker closed its pipe mid-message")
    return pickle.loads(data)


def serve(setup: Callable[[object], Callable[[object], object]]) -> None:
    """The worker side of the protocol, run by a worker module's main().

    `setup(settings)` loads what the worker needs and returns the function that answers each message;
    an exception it raises is sent to the parent (which raises it as ValueError) and the worker exits.
    Returns when the parent closes the pipe.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the parent
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # prints from the worker's code must not corrupt the answer pipe
    settings = read_message(stdin)
    try:
        handle = setup(settings)
        write_message(stdout, None)  # ready
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        write_message(stdout, f"{type(e).__name__}: {e}")
        return
    while True:
        try:
            message = read_message(stdin)
        except EOFError:
            return
        write_message(stdout, handle(message))


class Worker:
    """One worker subprocess (`python -m module`), started with `settings` and ready to answer.

    `name` ("a tool worker") and `loads` (what it loads, as the user configures it) word the errors
    raised when it cannot start.
    """

    def __init__(self, module: str, settings, ready_timeout_s: float, name: str = "a worker",
                 loads: str = "its settings"):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen([sys.executable, "-m", module],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.job: tuple[int, float] | None = None  # (message index, when it must be answered by)
        try:
            write_message(self.proc.stdin, settings)
        except OSError:
            pass  # it died at start: the read below says how
        if not select.select([self.proc.stdout], [], [], ready_timeout_s)[0]:
            self.kill()
            raise TimeoutError(f"{name} did not start within {ready_timeout_s:.0f} s")
        try:
            error = read_message(self.proc.stdout)
        except EOFError:
            error = f"it exited with code {self.proc.wait()} while loading"
        if error is not None:
            self.kill()
            raise ValueError(f"{name} could not load {loads}: {error}")

    def send(self, message, index: int = 0, deadline: float = math.inf) -> None:
        """Hand the worker one message; `deadline` (time.monotonic()) is when the pool kills it."""
        write_message(self.proc.stdin, message)
        self.job = (index, deadline)

    def receive(self):
        """The answer to the message sent (blocks until it comes; EOFError if the worker died)."""
        self.job = None
        return read_message(self.proc.stdout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self, wait_s: float = 1.0) -> int | None:
        """The process's exit code (negative: the signal that ended it); None if it is still running."""
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


@dataclass(frozen=True)
class Outcome:
    """What became of one message of `SubprocessPool.run`."""

    status: Literal["done", "died", "timeout", "in_flight", "not_started"]
    """done: answered; died: its worker ended while on it; timeout: killed past its limit plus the grace;
    in_flight / not_started: the batch budget ran out while it ran / before it was sent."""
    reply: object = None
    """The worker's answer (done only)."""
    exit_code: int | None = None
    """died: the worker's exit code (negative: the signal); None if it had not exited within a second."""


class SubprocessPool:
    """`num_workers` slots, each holding a worker started on first use and replaced when it died or was
    killed (see the module docstring for the guarantees)."""

    def __init__(self, module: str, settings, num_workers: int, ready_timeout_s: float = 60.0,
                 kill_grace_s: float = 1.0, name: str = "a worker", loads: str = "its settings"):
        if num_workers < 1:
            raise ValueError(f"SubprocessPool needs num_workers >= 1, got {num_workers}")
        self.module, self.settings, self.name, self.loads = module, settings, name, loads
        self.ready_timeout_s = ready_timeout_s
        self.kill_grace_s = kill_grace_s
        self.workers: list[Worker | None] = [None] * num_workers

    def worker(self, i: int) -> Worker:
        """Slot i's worker, started (or replaced, if it died) now."""
        w = self.workers[i]
        if w is None or not w.alive():
            if w is not None:
                w.kill()
            w = self.workers[i] = Worker(self.module, self.settings, self.ready_timeout_s, self.name, self.loads)
        return w

    def drop(self, i: int) -> None:
        """Kill slot i's worker; the slot starts a fresh one when next used."""
        w, self.workers[i] = self.workers[i], None
        if w is not None:
            w.kill()

    def run(self, messages: list, limits_s: list[float] | None = None, budget_s: float = 0.0,
            on_outcome: Callable[[int, Outcome], None] | None = None) -> list[Outcome]:
        """Answer every message on the workers, one message per worker at a time; outcomes in message order.

        limits_s[k]: seconds message k may run before its worker is killed (after a further
        kill_grace_s; math.inf, or no limits_s: none). budget_s: seconds the whole call may run (0: none),
        counted once the workers have started. on_outcome(k, outcome) is called as each message ends
        (not for those the budget stopped).
        """
        n = len(messages)
        outcomes: list[Outcome | None] = [None] * n
        pending = deque(range(n))
        for i in range(min(len(self.workers), n)):
            self.worker(i)  # start-up is charged to no message and not to the budget
        budget_end = time.monotonic() + budget_s if budget_s > 0 else math.inf

        def finish(k: int, outcome: Outcome) -> None:
            outcomes[k] = outcome
            if on_outcome is not None:
                on_outcome(k, outcome)

        def died(i: int, k: int) -> None:
            code = self.workers[i].exit_code()
            self.drop(i)
            finish(k, Outcome("died", exit_code=code))

        try:
            while pending or self._busy():
                for i in range(len(self.workers)):
                    if pending and (self.workers[i] is None or self.workers[i].job is None):
                        k = pending.popleft()
                        w = self.worker(i)  # a replacement's start-up is not charged to this message
                        limit = limits_s[k] if limits_s else math.inf
                        try:
                            w.send(messages[k], k, time.monotonic() + limit + self.kill_grace_s)
                        except OSError:  # it died between the check and the write
                            died(i, k)
                busy = {w.proc.stdout: i for i, w in enumerate(self.workers) if w is not None and w.job is not None}
                if not busy:
                    continue
                wake = min([budget_end] + [self.workers[i].job[1] for i in busy.values()])
                wait = None if wake == math.inf else max(0.0, wake - time.monotonic())
                for stream in select.select(list(busy), [], [], wait)[0]:
                    i = busy[stream]
                    k = self.workers[i].job[0]
                    try:
                        reply = self.workers[i].receive()
                    except (EOFError, OSError, pickle.UnpicklingError):
                        died(i, k)
                    else:
                        finish(k, Outcome("done", reply=reply))
                now = time.monotonic()
                for i, w in enumerate(self.workers):
                    if w is not None and w.job is not None and now >= w.job[1]:
                        k = w.job[0]
                        self.drop(i)  # the code outlived its limit: only killing the process stops it
                        finish(k, Outcome("timeout"))
                if now >= budget_end:
                    for i, w in enumerate(self.workers):
                        if w is not None and w.job is not None:
                            outcomes[w.job[0]] = Outcome("in_flight")
                            self.drop(i)
                    for k in pending:
                        outcomes[k] = Outcome("not_started")
                    break
        except BaseException:
            # A worker that failed to start, an on_outcome that raised, Ctrl-C: the busy workers' answers
            # would reach the next call as its own, so they go.
            for i, w in enumerate(self.workers):
                if w is not None and w.job is not None:
                    self.drop(i)
            raise
        return outcomes

    def _busy(self) -> bool:
        return any(w is not None and w.job is not None for w in self.workers)

    def close(self) -> None:
        """Stop the worker processes (a later `run` starts new ones)."""
        for i in range(len(self.workers)):
            self.drop(i)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
