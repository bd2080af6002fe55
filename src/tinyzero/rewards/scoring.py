"""Scoring many samples: per-sample time limit, error capture, and an optional process pool.

A task is (data_source, solution_str, ground_truth, extra_info). Every task yields a dict
{"score", "acc", "formatted", "error", "timeout"}; a scorer that raises or runs past the time
limit yields score 0 with `error` (the exception text) or `timeout` set, and the batch goes on.

The time limit uses SIGALRM in the main thread of the scoring process (the trainer's main
thread, or a pool worker's). Its exception derives from BaseException so a scorer's own
`except Exception` cannot swallow it. Pool workers are plain subprocesses running
`python -m tinyzero.rewards.scoring_worker` (started once, reused), fed over pipes; unlike a
multiprocessing pool they never re-import the trainer's main script. Each worker's chunk also
has a deadline: a worker stuck in C code past it is killed, its samples count as timeouts,
and the next call starts a fresh worker.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager

from tinyzero.rewards.registry import get_scorer, load_custom_fn, normalize_result

__all__ = ["score_tasks", "ScoringPool", "ScoreTimeout"]


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
    return {"score": 0.0, "acc": False, "formatted": False, "error": error, "timeout": timeout}


def _score_one(task, custom_fn: str | None, options: dict, timeout_s: float, alarm: bool) -> dict:
    data_source, solution_str, ground_truth, extra_info = task
    try:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            if custom_fn:
                raw = load_custom_fn(custom_fn)(data_source, solution_str, ground_truth, extra_info)
            else:
                raw = get_scorer(data_source)(solution_str, ground_truth, extra_info, **options)
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
        out = normalize_result(raw)
    except ScoreTimeout:
        return _failed(timeout=True)
    except Exception as e:  # noqa: BLE001 - a broken scorer must not stop training
        return _failed(error=f"{type(e).__name__}: {e}"[:500])
    out["error"] = None
    out["timeout"] = False
    return out


def score_tasks(tasks, custom_fn: str | None = None, options: dict | None = None,
                timeout_s: float = 0.0) -> list[dict]:
    """Score tasks in this process, each under the time limit (0: none)."""
    options = options or {}
    with _alarm_installed(timeout_s > 0) as alarm:
        return [_score_one(t, custom_fn, options, timeout_s, alarm) for t in tasks]


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
    def __init__(self, settings: tuple):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tinyzero.rewards.scoring_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        write_message(self.proc.stdin, settings)

    def run(self, tasks: list) -> list[dict]:
        write_message(self.proc.stdin, tasks)
        return read_message(self.proc.stdout)

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


class ScoringPool:
    """Reusable scoring subprocesses; each call splits the tasks into one chunk per worker."""

    def __init__(self, num_workers: int, custom_fn: str | None = None, options: dict | None = None,
                 timeout_s: float = 0.0, slack_s: float = 60.0):
        if num_workers < 1:
            raise ValueError(f"ScoringPool needs num_workers >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.settings = (custom_fn, dict(options or {}), timeout_s)
        self.timeout_s = timeout_s
        self.slack_s = slack_s
        self._workers: list[_Worker | None] = [None] * num_workers
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="reward-score")

    def _worker(self, i: int) -> _Worker:
        w = self._workers[i]
        if w is None or not w.alive():
            if w is not None:
                w.kill()
            w = self._workers[i] = _Worker(self.settings)
        return w

    def score(self, tasks: list) -> list[dict]:
        """Score tasks across the workers; order is preserved."""
        if not tasks:
            return []
        size = math.ceil(len(tasks) / self.num_workers)
        chunks = [tasks[i:i + size] for i in range(0, len(tasks), size)]
        workers = [self._worker(i) for i in range(len(chunks))]
        futures = [self._threads.submit(w.run, c) for w, c in zip(workers, chunks)]
        # Every sample may use its full limit, plus slack for start-up and transfer.
        deadline = time.monotonic() + (self.timeout_s * size + self.slack_s if self.timeout_s > 0 else 3600.0)
        results: list[dict] = []
        for i, (chunk, future) in enumerate(zip(chunks, futures)):
            try:
                results.extend(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
            except (FutureTimeout, EOFError, OSError, pickle.UnpicklingError):
                workers[i].kill()  # also unblocks the thread waiting on its pipe
                self._workers[i] = None
                results.extend(_failed(timeout=True) for _ in chunk)
        return results

    def close(self) -> None:
        """Stop the worker processes (a later `score` starts new ones)."""
        for i, w in enumerate(self._workers):
            if w is not None:
                w.kill()
                self._workers[i] = None

    def __del__(self):
        try:
            self.close()
            self._threads.shutdown(wait=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
