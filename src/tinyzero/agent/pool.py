"""Tool calls in killable worker processes, with a time limit per call and a memory limit per worker.

    pool = ToolPool(["calculator"], num_workers=2, memory_mb=1024, max_chars=2000)
    results = pool.run([("calculator", {"expression": "6*7"}, 2.0)])   # [ToolResult("42", ...)]
    pool.close()

Each worker (`python -m tinyzero.agent.tool_worker`, in a tinyzero.runtime.subprocess_pool.SubprocessPool)
runs one call at a time; calls are spread over the workers. A call still running past its timeout is
killed with its worker (a fresh one takes the next call); a worker that dies (a crash, the memory
limit) answers its call with an error. Every call therefore returns, within
its timeout plus `kill_grace_s`, a `ToolResult`: the text, or the error the model will read.

The run goes on after such a failure, so besides the agent/* metrics it is said on the console:
the first call of each tool to time out, kill its process (a crash, a signal) or run out of memory
prints one line naming the tool; later ones of the same tool and kind print at most one line per
`notice_every_s` with their count.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass

from tinyzero.runtime.subprocess_pool import Outcome, SubprocessPool


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome: `text` is the tool's answer, or the error message when error/timeout is set."""

    text: str
    error: bool = False
    timeout: bool = False


# Each kind of failure on the console: what happened to the call ({detail}: the limit, the exit) and
# the metric that counts it.
_FAILURES = {
    "timeout": ("ran past its time limit of {detail} and was killed (rollout.multi_turn.tool_timeout_s, or the "
                "tool's own timeout_s)", "agent/tool_timeouts/total"),
    "died": ("crashed: its process ended ({detail})", "agent/tool_errors/total"),
    "memory": ("ran out of memory (rollout.multi_turn.tool_memory_mb)", "agent/tool_errors/total"),
}


class FailureNotices:
    """Console lines for tool failures that would otherwise show only in the metrics: the first of each
    (tool, kind), then at most one per `every_s` seconds with the count since the last line."""

    def __init__(self, every_s: float = 300.0):
        self.every_s = every_s
        self.last: dict[tuple[str, str], float] = {}
        self.since: Counter = Counter()

    def note(self, tool: str, kind: str, detail: str = "") -> str | None:
        """Count one failure; returns the line printed (None when rate-limited)."""
        key, now = (tool, kind), time.monotonic()
        self.since[key] += 1
        last = self.last.get(key)
        if last is not None and now - last < self.every_s:
            return None
        count = self.since.pop(key)
        self.last[key] = now
        what, metric = _FAILURES[kind]
        again = "" if last is None else f" ({count} such calls in the last {now - last:.0f} s)"
        from tinyzero.distributed import get_rank

        line = (f"[rank {get_rank()}] warning: tool {tool!r} {what.format(detail=detail)}{again}; the model reads "
                f"a tool error and the run goes on (counted in {metric}; repeats are summed here at most every "
                f"{self.every_s:g} s)")
        print(line, file=sys.stderr, flush=True)
        return line


def _exit_text(code: int | None) -> str:
    """A tool process's end in words: the signal that killed it, or its exit code."""
    if code is None:
        return "it did not exit"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ToolPool:
    """Worker processes that run tool calls (see the module docstring)."""

    def __init__(self, tool_specs: list[str], num_workers: int = 2, memory_mb: int = 1024, max_chars: int = 2000,
                 ready_timeout_s: float = 60.0, kill_grace_s: float = 1.0, notice_every_s: float = 300.0):
        if num_workers < 1:
            raise ValueError(f"ToolPool needs num_workers >= 1, got {num_workers}")
        self.workers = SubprocessPool("tinyzero.agent.tool_worker", (list(tool_specs), int(memory_mb), int(max_chars)),
                                      num_workers, ready_timeout_s=ready_timeout_s, kill_grace_s=kill_grace_s,
                                      name="a tool worker", loads="rollout.multi_turn.tools")
        self.notices = FailureNotices(notice_every_s)

    def run(self, calls: list[tuple[str, dict, float]]) -> list[ToolResult]:
        """Run (tool name, arguments, timeout_s) calls across the workers; results in call order."""
        results: list[ToolResult | None] = [None] * len(calls)

        def on_outcome(k: int, outcome: Outcome) -> None:
            name, _args, limit = calls[k]
            if outcome.status == "done":
                status, text = outcome.reply
                results[k] = ToolResult(text, error=status != "ok")
                if status == "memory":
                    self.notices.note(name, "memory")
            elif outcome.status == "died":
                results[k] = ToolResult(f"the tool process died (exit code {outcome.exit_code})", error=True)
                self.notices.note(name, "died", _exit_text(outcome.exit_code))
            else:
                results[k] = ToolResult(f"timed out after {limit:g} s", error=True, timeout=True)
                self.notices.note(name, "timeout", f"{limit:g} s")

        self.workers.run([(name, args) for name, args, _ in calls], [limit for _, _, limit in calls],
                         on_outcome=on_outcome)
        return results

    def close(self) -> None:
        self.workers.close()
