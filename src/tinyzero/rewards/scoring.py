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
batch at its budget. Pool workers are `python -m tinyzero.rewards.scoring_worker` subprocesses
(started once, reused) of a tinyzero.runtime.subprocess_pool.SubprocessPool.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from tinyzero.rewards.registry import DETAIL_SCORERS, get_scorer, load_custom_fn, normalize_result
from tinyzero.runtime.subprocess_pool import Outcome, SubprocessPool

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


class ScoringPool:
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
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        # slack_s: how long a worker may take to import the scorers and the user function
        self.workers = SubprocessPool("tinyzero.rewards.scoring_worker", (self.spec, timeout_s), num_workers,
                                      ready_timeout_s=slack_s, kill_grace_s=kill_grace_s,
                                      name="a reward scoring worker", loads="its scorer")

    def score(self, tasks: list, chunk_size: int | None = None, on_progress=None) -> list[dict]:
        """Score tasks across the workers; order is preserved (see the class docstring)."""
        n = len(tasks)
        if not n:
            return []
        size = chunk_size or max(1, min(256, math.ceil(n / (4 * self.num_workers))))
        chunks = [tasks[first:first + size] for first in range(0, n, size)]
        # The workers' own alarm stops each sample at timeout_s; the pool kills a chunk that outlives it.
        limits = [len(chunk) * self.timeout_s if self.timeout_s > 0 else math.inf for chunk in chunks]
        done = [0]

        def progress(k: int, outcome: Outcome) -> None:
            done[0] += len(chunks[k])
            if on_progress is not None:
                on_progress(done[0], n)

        outcomes = self.workers.run(chunks, limits, budget_s=self.batch_timeout_s, on_outcome=progress)
        results: list[dict] = []
        for chunk, outcome in zip(chunks, outcomes):
            if outcome.status == "done":
                results += outcome.reply
                continue
            if outcome.status == "died":
                failed = _failed(error=f"the scoring worker died (exit code {outcome.exit_code}) while scoring "
                                       "this sample")
            elif outcome.status == "timeout":
                failed = _failed(timeout=True)
            else:
                failed = {**_failed(timeout=True), "gave_up": outcome.status.replace("_", " ")}
            results += [dict(failed) for _ in chunk]
        return results

    def close(self) -> None:
        """Stop the worker processes (a later `score` starts new ones)."""
        self.workers.close()
