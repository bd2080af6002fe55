"""GSM8K reward (data_source openai/gsm8k): veRL's `verl/utils/reward_score/gsm8k.py` rule.

Only the last 300 characters of the response are read (veRL's clip; the answer sits at the end).
strict:   the last "#### <number>" (a run of digits, dots and commas, optionally after "-"), commas
          removed. The number must follow "#### " directly: "#### $72" holds no strict answer.
flexible: the last run of digits, dots and commas (optionally after "-") that is not just ".", as it
          stands: "... is 42." gives "42." and "1,234" stays "1,234" (when every run is ".", ".").
The extracted string is compared with the ground truth as given (veRL's gsm8k preprocessing writes
plain numbers without commas): equal scores `score` (1.0), found-but-different `format_score` (0.0),
no answer 0.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "score_details", "extract_solution"]

_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE_RE = re.compile(r"(\-?[0-9\.\,]+)")
_METHODS = ("strict", "flexible")
_CLIP_CHARS = 300


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string by `method`, or None when the response holds none."""
    if method not in _METHODS:
        raise ValueError(f"gsm8k: method must be one of {_METHODS}, got {method!r}")
    solution_str = solution_str[-_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT_RE.findall(solution_str)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _FLEXIBLE_RE.findall(solution_str)
    if not found:
        return None
    # veRL's loop leaves its variable on the first run when every run is ".": that "." is the answer.
    return next((t for t in reversed(found) if t not in ("", ".")), found[0])


def score_details(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> dict:
    """{"score", "acc", "formatted"} for one response."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return {"score": 0.0, "acc": False, "formatted": False}
    if answer == ground_truth:
        return {"score": float(score), "acc": True, "formatted": True}
    return {"score": float(format_score), "acc": False, "formatted": True}


def compute_score(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """GSM8K score of one response."""
    return score_details(solution_str, ground_truth, method, format_score, score)["score"]
