"""Tool calls in killable worker processes, with a time limit per call and a memory limit per worker.

    pool = ToolPool(["calculator"], num_workers=2, memory_mb=1024, max_chars=2000)
    results = pool.run([("calculator", {"expression": "6*7"}, 2.0)])   # [ToolResult("42", ...)]
    pool.close()

Each worker (`python -m tinyzero.agent.tool_worker`, a plain subprocess that never re-imports the
trainer's script) runs one call at a time; calls are spread over the workers. A call still running
past its timeout is killed with its worker (a fresh one takes the next call); a worker that dies
(a crash, the memory limit) answers its call with an error. Every call therefore returns, within
its timeout plus `kill_grace_s`, a `ToolResult`: the text, or the error the model will read.

The run goes on after such a failure, so besides the agent/* metrics it is said on the console:
the first call of each tool to time out, kill its process (a crash, a signal) or run out of memory
prints one line naming the tool; later ones of the same tool and kind print at most one line per
`notice_every_s` with their count.
"""

from __future__ import annotations

import pickle
import select
import subprocess
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass

from tinyzero.rewards.scoring import WorkerSlots, _Worker, write_message


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


class _ToolWorker(_Worker):
    """One tool subprocess (start-up, pipes and kill as a reward scoring worker's); one call at a time."""

    module = "tinyzero.agent.tool_worker"
    kind = "a tool worker"
    loads = "rollout.multi_turn.tools"

    def send(self, index: int, name: str, args: dict, timeout_s: float) -> None:
        write_message(self.proc.stdin, (name, args))
        self.busy = (index, time.monotonic(), timeout_s)


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


class ToolPool(WorkerSlots):
    """Worker processes that run tool calls (see the module docstring)."""

    def __init__(self, tool_specs: list[str], num_workers: int = 2, memory_mb: int = 1024, max_chars: int = 2000,
                 ready_timeout_s: float = 60.0, kill_grace_s: float = 1.0, notice_every_s: float = 300.0):
        if num_workers < 1:
            raise ValueError(f"ToolPool needs num_workers >= 1, got {num_workers}")
        self.settings = (list(tool_specs), int(memory_mb), int(max_chars))
        self.ready_timeout_s = ready_timeout_s
        self.kill_grace_s = kill_grace_s
        self.notices = FailureNotices(notice_every_s)
        super().__init__(num_workers)

    def _new_worker(self) -> _ToolWorker:
        return _ToolWorker(self.settings, self.ready_timeout_s)

    def run(self, calls: list[tuple[str, dict, float]]) -> list[ToolResult]:
        """Run (tool name, arguments, timeout_s) calls across the workers; results in call order."""
        results: list[ToolResult | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        n = len(self._workers)
        while pending or any(w is not None and w.busy for w in self._workers):
            for i in range(n):
                if pending and (self._workers[i] is None or not self._workers[i].busy):
                    k = pending.popleft()
                    self._worker(i).send(k, *calls[k])
            busy = {w.proc.stdout: i for i, w in enumerate(self._workers) if w is not None and w.busy}
            for stream in select.select(list(busy), [], [], 0.02)[0]:
                i = busy[stream]
                k = self._workers[i].busy[0]
                try:
                    status, text = self._workers[i].receive()
                    results[k] = ToolResult(text, error=status != "ok")
                    if status == "memory":
                        self.notices.note(calls[k][0], "memory")
                except (EOFError, OSError, pickle.UnpicklingError):
                    try:
                        code = self._workers[i].proc.wait(timeout=1.0)
                    except subprocess.TimeoutExpired:
                        code = None
                    self._drop(i)
                    results[k] = ToolResult(f"the tool process died (exit code {code})", error=True)
                    self.notices.note(calls[k][0], "died", _exit_text(code))
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w is not None and w.busy and now - w.busy[1] > w.busy[2] + self.kill_grace_s:
                    k, _, limit = w.busy
                    self._drop(i)  # only killing the process stops a call that hangs
                    results[k] = ToolResult(f"timed out after {limit:g} s", error=True, timeout=True)
                    self.notices.note(calls[k][0], "timeout", f"{limit:g} s")
        return results

    def close(self) -> None:
        for i in range(len(self._workers)):
            self._drop(i)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
