"""Tool calls in killable worker processes, with a time limit per call and a memory limit per worker.

    pool = ToolPool(["calculator"], num_workers=2, memory_mb=1024, max_chars=2000)
    results = pool.run([("calculator", {"expression": "6*7"}, 2.0)])   # [ToolResult("42", ...)]
    pool.close()

Each worker (`python -m tinyzero.agent.tool_worker`, a plain subprocess that never re-imports the
trainer's script) runs one call at a time; calls are spread over the workers. A call still running
past its timeout is killed with its worker (a fresh one takes the next call); a worker that dies
(a crash, the memory limit) answers its call with an error. Every call therefore returns, within
its timeout plus `kill_grace_s`, a `ToolResult`: the text, or the error the model will read.
"""

from __future__ import annotations

import pickle
import select
import subprocess
import time
from collections import deque
from dataclasses import dataclass

from tinyzero.rewards.scoring import WorkerSlots, _Worker, write_message


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome: `text` is the tool's answer, or the error message when error/timeout is set."""

    text: str
    error: bool = False
    timeout: bool = False


class _ToolWorker(_Worker):
    """One tool subprocess (start-up, pipes and kill as a reward scoring worker's); one call at a time."""

    module = "tinyzero.agent.tool_worker"
    kind = "a tool worker"
    loads = "rollout.multi_turn.tools"

    def send(self, index: int, name: str, args: dict, timeout_s: float) -> None:
        write_message(self.proc.stdin, (name, args))
        self.busy = (index, time.monotonic(), timeout_s)


class ToolPool(WorkerSlots):
    """Worker processes that run tool calls (see the module docstring)."""

    def __init__(self, tool_specs: list[str], num_workers: int = 2, memory_mb: int = 1024, max_chars: int = 2000,
                 ready_timeout_s: float = 60.0, kill_grace_s: float = 1.0):
        if num_workers < 1:
            raise ValueError(f"ToolPool needs num_workers >= 1, got {num_workers}")
        self.settings = (list(tool_specs), int(memory_mb), int(max_chars))
        self.ready_timeout_s = ready_timeout_s
        self.kill_grace_s = kill_grace_s
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
                except (EOFError, OSError, pickle.UnpicklingError):
                    try:
                        code = self._workers[i].proc.wait(timeout=1.0)
                    except subprocess.TimeoutExpired:
                        code = None
                    self._drop(i)
                    results[k] = ToolResult(f"the tool process died (exit code {code})", error=True)
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w is not None and w.busy and now - w.busy[1] > w.busy[2] + self.kill_grace_s:
                    k, _, limit = w.busy
                    self._drop(i)  # only killing the process stops a call that hangs
                    results[k] = ToolResult(f"timed out after {limit:g} s", error=True, timeout=True)
        return results

    def close(self) -> None:
        for i in range(len(self._workers)):
            self._drop(i)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
