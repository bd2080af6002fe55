"""Scoring many samples: per-sample time limit, error capture, and an optional process pool.

A task is (data_source, solution_str, ground_truth, extra_info). Every task yields a dict
{"score", "acc", "formatted", "error", "timeout"}; a scorer that raises or runs past the time
limit yields score 0 with `error` (the exception text) or `timeout` set, and the batch goes on.

The time limit uses SIGALRM in the main thread of the scoring process (the trainer's main
thread, or a pool worker's). Its exception derives from BaseException so a scorer's own
`except Exception` cannot swallow it. The pool (spawned processes, created once and reused)
also guards each chunk with a deadline: a worker stuck in C code past it is terminated, its
samples count as timeouts, and the next call starts a fresh pool.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import signal
import threading
import time
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


_WORKER_ARGS: tuple = (None, {}, 0.0)


def _init_worker(custom_fn, options, timeout_s):
    global _WORKER_ARGS
    _WORKER_ARGS = (custom_fn, options, timeout_s)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the parent


def _score_chunk(tasks):
    custom_fn, options, timeout_s = _WORKER_ARGS
    return score_tasks(tasks, custom_fn, options, timeout_s)


class ScoringPool:
    """A reusable pool of spawned scoring processes with a per-chunk deadline."""

    def __init__(self, num_workers: int, custom_fn: str | None = None, options: dict | None = None,
                 timeout_s: float = 0.0, chunks_per_worker: int = 4):
        if num_workers < 1:
            raise ValueError(f"ScoringPool needs num_workers >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.custom_fn = custom_fn
        self.options = dict(options or {})
        self.timeout_s = timeout_s
        self.chunks_per_worker = chunks_per_worker
        self._pool = None

    def _ensure_pool(self):
        if self._pool is None:
            ctx = mp.get_context("spawn")
            self._pool = ctx.Pool(self.num_workers, initializer=_init_worker,
                                  initargs=(self.custom_fn, self.options, self.timeout_s))
        return self._pool

    def score(self, tasks: list) -> list[dict]:
        """Score tasks across the pool; order is preserved."""
        if not tasks:
            return []
        pool = self._ensure_pool()
        size = math.ceil(len(tasks) / (self.num_workers * self.chunks_per_worker))
        chunks = [tasks[i:i + size] for i in range(0, len(tasks), size)]
        handles = [pool.apply_async(_score_chunk, (c,)) for c in chunks]
        # Deadline per chunk: every sample may use its full limit, plus start-up slack.
        deadline = None
        if self.timeout_s > 0:
            deadline = time.monotonic() + self.timeout_s * size + 120.0
        results: list[dict] = []
        broken = False
        for chunk, handle in zip(chunks, handles):
            if broken:
                results.extend(_failed(timeout=True) for _ in chunk)
                continue
            try:
                wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                results.extend(handle.get(wait))
            except mp.TimeoutError:
                broken = True
                results.extend(_failed(timeout=True) for _ in chunk)
        if broken:
            self.close()
        return results

    def close(self) -> None:
        """Terminate the worker processes (a later `score` starts a new pool)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
