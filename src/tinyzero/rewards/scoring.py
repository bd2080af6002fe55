"""Scoring many samples: per-sample time limit, error capture, and a pool of killable processes.

A task is (data_source, solution_str, ground_truth, extra_info). Every task yields a dict
{"score", "acc", "formatted", "extra", "error", "timeout"} ("extra": every key of a dict result, the
sample's reward_extra_info); a scorer that raises, returns something that is not a finite score, or
runs past the time limit yields score 0 with `error` (the exception text; the formatted traceback
under "traceback") or `timeout` set, and the batch goes on. What a failure then means (stop the run,
or count it) is RewardManager's decision (reward.on_error).

How a user function is called is a `ScorerSpec`: positionally `fn(data_source, solution_str,
ground_truth, extra_info)` (reward.custom_fn), with veRL's keywords and reward_kwargs
(custom_reward_function), once per batch with lists (veRL's batch reward manager), or as veRL's prime
manager calls it (positionally plus reward_kwargs; a tuple's first element is the score, None is 0).
An `async def` function is run to completion in the scoring process.

The time limit uses SIGALRM in the main thread of the scoring process (the trainer's main
thread, or a pool worker's). Its exception derives from BaseException so a scorer's own
`except Exception` cannot swallow it; a bare `except:` can, which is why user functions run in
pool workers: ScoringPool kills a worker still busy past the limit (plus a grace), and stops a
batch at its budget. Pool workers are plain subprocesses running
`python -m tinyzero.rewards.scoring_worker` (started once, reused), fed over pipes; unlike a
multiprocessing pool they never re-import the trainer's main script.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from tinyzero.rewards.registry import DETAIL_SCORERS, get_scorer, load_custom_fn, normalize_result

__all__ = ["score_tasks", "ScoringPool", "ScoreTimeout", "ScorerSpec"]


@dataclass
class ScorerSpec:
    """What scores a task and how it is called (sent once to every scoring worker)."""

    custom_fn: str | None = None
    """`path/to/file.py:name` of a user function; None: the built-in scorer of each data_source."""
    call: Literal["positional", "keyword", "batch", "prime"] = "positional"
    """How the user function is called (see the module docstring)."""
    reward_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of every user-function call."""
    options: dict = field(default_factory=dict)
    """Keyword options of the built-in scorers (RewardConfig.scorer_options)."""


async def _awaited(awaitable):
    return await awaitable


def _resolve(raw):
    """The value of an `async def` function's result (run to completion here)."""
    return asyncio.run(_awaited(raw)) if inspect.isawaitable(raw) else raw


def _call(spec: ScorerSpec, task) -> object:
    data_source, solution_str, ground_truth, extra_info = task
    if not spec.custom_fn:
        return get_scorer(data_source)(solution_str, ground_truth, extra_info, **spec.options)
    fn = load_custom_fn(spec.custom_fn)
    if spec.call == "keyword":
        kwargs = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                  "extra_info": extra_info, **spec.reward_kwargs}
        return _resolve(fn(**kwargs))
    if spec.call == "prime":
        raw = _resolve(fn(data_source, solution_str, ground_truth, extra_info, **spec.reward_kwargs))
        if raw is None:
            return 0.0
        return raw[0] if isinstance(raw, (tuple, list)) and raw else raw
    return _resolve(fn(data_source, solution_str, ground_truth, extra_info))


class ScoreTimeout(BaseException):
    """Raised inside a scorer that exceeded the per-sample time limit."""


def _alarm_handler(signum, frame):
    raise ScoreTimeout()


@contextmanager
def _alarm_installed(enabled: bool):
    """Install the SIGALRM handler for a batch (main thread only); yields whether limits work."""
    usable = enabled and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield False
        return
    old_handler = signal.signal(signal.SIGALRM, _alarm_handler)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, 0)
    start = time.monotonic()
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:  # give back someone else's pending alarm
            remaining = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, old_interval)


def _failed(error: str | None = None, timeout: bool = False) -> dict:
    return {"score": 0.0, "acc": False, "formatted": False, "extra": {}, "error": error, "timeout": timeout}


def _score_one(task, spec: ScorerSpec, timeout_s: float, alarm: bool) -> dict:
    try:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            raw = _call(spec, task)
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
        out = normalize_result(raw)
        if not spec.custom_fn and get_scorer(task[0]) in DETAIL_SCORERS:
            out["extra"] = {}  # tinyzero's detail record: the public result is the bare score
    except ScoreTimeout:
        return _failed(timeout=True)
    except Exception as e:  # noqa: BLE001 - reported to RewardManager, which applies reward.on_error
        return {**_failed(error=f"{type(e).__name__}: {e}"[:500]), "traceback": traceback.format_exc()[-4000:]}
    out["error"] = None
    out["timeout"] = False
    return out


def _score_batch(tasks: list, spec: ScorerSpec, timeout_s: float, alarm: bool) -> list[dict]:
    """veRL's batch reward manager: one call with lists, under len(tasks) x the per-sample limit."""
    if not tasks:
        return []
    try:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, timeout_s * len(tasks))
        try:
            columns = list(zip(*tasks))
            raw = load_custom_fn(spec.custom_fn)(
                **{"data_sources": list(columns[0]), "solution_strs": list(columns[1]),
                   "ground_truths": list(columns[2]), "extra_infos": list(columns[3]), **spec.reward_kwargs})
            raw = _resolve(raw)
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
        if not isinstance(raw, (list, tuple)) or len(raw) != len(tasks):
            got = f"{type(raw).__name__} of length {len(raw)}" if hasattr(raw, "__len__") else type(raw).__name__
            raise TypeError(f"the batch reward function must return a list with one score per sample "
                            f"({len(tasks)}), got {got}")
    except ScoreTimeout:
        return [_failed(timeout=True) for _ in tasks]
    except Exception as e:  # noqa: BLE001 - reported to RewardManager, which applies reward.on_error
        error = {**_failed(error=f"{type(e).__name__}: {e}"[:500]), "traceback": traceback.format_exc()[-4000:]}
        return [dict(error) for _ in tasks]
    out = []
    for value in raw:
        try:
            out.append({**normalize_result(value), "error": None, "timeout": False})
        except (TypeError, ValueError) as e:
            out.append(_failed(error=f"{type(e).__name__}: {e}"[:500]))
    return out


def score_tasks(tasks, custom_fn: str | None = None, options: dict | None = None,
                timeout_s: float = 0.0, spec: ScorerSpec | None = None) -> list[dict]:
    """Score tasks in this process, each under the time limit (0: none). `spec` (or custom_fn +
    options, a positional call) says what scores them."""
    spec = spec or ScorerSpec(custom_fn=custom_fn, options=dict(options or {}))
    with _alarm_installed(timeout_s > 0) as alarm:
        if spec.call == "batch":
            return _score_batch(list(tasks), spec, timeout_s, alarm)
        return [_score_one(t, spec, timeout_s, alarm) for t in tasks]


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
        raise EOFError("scoring worker closed its pipe")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("scoring worker closed its pipe mid-message")
    return pickle.loads(data)


class _Worker:
    """One scoring subprocess; answers one task list at a time (so a select() on its pipe is exact).
    Other worker kinds (tinyzero.agent.pool) change `module` (run with -m) and the names in errors."""

    module = "tinyzero.rewards.scoring_worker"
    kind = "a reward scoring worker"
    loads = "its scorer"

    def __init__(self, settings: tuple, ready_timeout_s: float):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        write_message(self.proc.stdin, settings)
        # The worker answers once it has imported the scorers (and the user function): start-up is not
        # charged to the first sample's time limit.
        if not select.select([self.proc.stdout], [], [], ready_timeout_s)[0]:
            self.kill()
            raise TimeoutError(f"{self.kind} did not start within {ready_timeout_s:.0f} s")
        try:
            error = read_message(self.proc.stdout)
        except EOFError:
            error = f"it exited with code {self.proc.wait()} while loading"
        if error is not None:
            self.kill()
            raise ValueError(f"{self.kind} could not load {self.loads}: {error}")
        self.busy: tuple[int, int, float] | None = None  # (first task, end, when it was sent)

    def send(self, tasks: list, first: int) -> None:
        write_message(self.proc.stdin, tasks)
        self.busy = (first, first + len(tasks), time.monotonic())

    def receive(self) -> list[dict]:
        self.busy = None
        return read_message(self.proc.stdout)

    def run(self, tasks: list) -> list[dict]:
        self.send(tasks, 0)
        return self.receive()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class WorkerSlots:
    """A fixed number of worker-process slots, each started on first use and replaced when it died."""

    def __init__(self, num_workers: int):
        self._workers: list[_Worker | None] = [None] * num_workers

    def _new_worker(self) -> _Worker:
        raise NotImplementedError

    def _worker(self, i: int) -> _Worker:
        w = self._workers[i]
        if w is None or not w.alive():
            if w is not None:
                w.kill()
            w = self._workers[i] = self._new_worker()
        return w

    def _drop(self, i: int) -> None:
        w, self._workers[i] = self._workers[i], None
        if w is not None:
            w.kill()


class ScoringPool(WorkerSlots):
    """Scoring subprocesses that can be killed: per-sample limits that hold, and a per-batch budget.

    Tasks go out in chunks (`chunk_size`; 1 for user functions, so a failure names its sample),
    one chunk per worker at a time. A worker busy on a chunk past len(chunk) x timeout_s +
    `kill_grace_s` (its function ignored or caught the per-sample alarm) is killed: the chunk's
    samples are timeouts and a fresh worker takes the next chunk. A worker that dies gives its
    chunk an error. Once the batch has run `batch_timeout_s` (0: no budget), busy workers are killed
    and the unscored samples come back with timeout set and `gave_up` saying "in flight" or "not
    started". `on_progress(done, total)` is called as chunks complete.
    """

    def __init__(self, num_workers: int, custom_fn: str | None = None, options: dict | None = None,
                 timeout_s: float = 0.0, slack_s: float = 60.0, batch_timeout_s: float = 0.0,
                 kill_grace_s: float = 2.0, spec: ScorerSpec | None = None):
        if num_workers < 1:
            raise ValueError(f"ScoringPool needs num_workers >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.spec = spec or ScorerSpec(custom_fn=custom_fn, options=dict(options or {}))
        self.settings = (self.spec, timeout_s)
        self.timeout_s = timeout_s
        self.slack_s = slack_s
        self.batch_timeout_s = batch_timeout_s
        self.kill_grace_s = kill_grace_s
        super().__init__(num_workers)

    def _new_worker(self) -> _Worker:
        return _Worker(self.settings, self.slack_s)

    def score(self, tasks: list, chunk_size: int | None = None, on_progress=None) -> list[dict]:
        """Score tasks across the workers; order is preserved (see the class docstring)."""
        n = len(tasks)
        if not n:
            return []
        size = chunk_size or max(1, min(256, math.ceil(n / (4 * self.num_workers))))
        pending = deque(range(0, n, size))
        results: list[dict | None] = [None] * n
        done = 0
        for i in range(min(self.num_workers, len(pending))):
            self._worker(i)  # start-up (imports, the user module) is not charged to the batch
        budget_end = time.monotonic() + self.batch_timeout_s if self.batch_timeout_s > 0 else math.inf
        while pending or any(w is not None and w.busy for w in self._workers):
            for i in range(self.num_workers):
                if pending and (self._workers[i] is None or not self._workers[i].busy):
                    first = pending.popleft()
                    self._worker(i).send(tasks[first:first + size], first)
            busy = {w.proc.stdout: i for i, w in enumerate(self._workers) if w is not None and w.busy}
            ready = select.select(list(busy), [], [], 0.05)[0]
            for stream in ready:
                i = busy[stream]
                first, end, _ = self._workers[i].busy
                try:
                    results[first:end] = self._workers[i].receive()
                except (EOFError, OSError, pickle.UnpicklingError):
                    code = self._workers[i].proc.poll()
                    self._drop(i)
                    results[first:end] = [_failed(error=f"the scoring worker died (exit code {code}) while "
                                                        "scoring this sample") for _ in range(end - first)]
                done += end - first
                if on_progress is not None:
                    on_progress(done, n)
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w is None or not w.busy:
                    continue
                first, end, sent = w.busy
                if self.timeout_s > 0 and now - sent > (end - first) * self.timeout_s + self.kill_grace_s:
                    self._drop(i)  # the function outlived its alarm: only killing it stops it
                    results[first:end] = [_failed(timeout=True) for _ in range(end - first)]
                    done += end - first
            if now > budget_end:
                for i, w in enumerate(self._workers):
                    if w is not None and w.busy:
                        first, end, _ = w.busy
                        self._drop(i)
                        results[first:end] = [{**_failed(timeout=True), "gave_up": "in flight"}
                                              for _ in range(end - first)]
                for first in pending:
                    results[first:first + size] = [{**_failed(timeout=True), "gave_up": "not started"}
                                                   for _ in range(min(size, n - first))]
                break
        return results

    def close(self) -> None:
        """Stop the worker processes (a later `score` starts new ones)."""
        for i in range(self.num_workers):
            self._drop(i)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
