"""A scoring worker process: `python -m tinyzero.rewards.scoring_worker`, started by ScoringPool.

Its settings are (ScorerSpec, timeout_s): it loads the user function, if any, then answers each task
list with the list of score dicts (tinyzero.runtime.subprocess_pool.serve: length-prefixed pickles on
its pipes, the parent its only peer).
"""

from __future__ import annotations

from tinyzero.rewards.registry import load_custom_fn
from tinyzero.rewards.scoring import ScorerSpec, score_tasks
from tinyzero.runtime.subprocess_pool import serve


def setup(settings: tuple[ScorerSpec, float]):
    """Load the scorer; the function that scores one task list."""
    spec, timeout_s = settings
    if spec.custom_fn:
        load_custom_fn(spec.custom_fn)
    return lambda tasks: score_tasks(tasks, timeout_s=timeout_s, spec=spec)


def main() -> None:
    serve(setup)


if __name__ == "__main__":
    main()
