"""A scoring worker process: `python -m tinyzero.rewards.scoring_worker`, started by ScoringPool.

Reads (ScorerSpec, timeout_s) once from stdin and answers None once its scorer is loaded
(or the error text), then reads task lists and answers each with the list of score dicts on stdout
(length-prefixed pickles; the parent is its only peer).
"""

from __future__ import annotations

import signal
import sys

from tinyzero.rewards.registry import load_custom_fn
from tinyzero.rewards.scoring import read_message, score_tasks, write_message


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the parent
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # prints from scorers must not corrupt the result pipe
    spec, timeout_s = read_message(stdin)
    try:
        if spec.custom_fn:
            load_custom_fn(spec.custom_fn)
        write_message(stdout, None)  # ready
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        write_message(stdout, f"{type(e).__name__}: {e}")
        return
    while True:
        try:
            tasks = read_message(stdin)
        except EOFError:
            return
        write_message(stdout, score_tasks(tasks, timeout_s=timeout_s, spec=spec))


if __name__ == "__main__":
    main()
