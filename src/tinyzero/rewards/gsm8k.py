"""GSM8K reward: the final answer after "####" (strict) or the last number (flexible).

strict:   the last "#### <number>" in the response, commas removed. As in veRL and TinyZero the
          number must follow "#### " directly: "#### $72" holds no strict answer and scores 0.
flexible: the last number-looking run of digits, dots and commas that is not just "."; commas
          removed and trailing dots dropped ("... is 42." gives "42").
The extracted string is compared with the ground truth as a string, as veRL does; a
found-but-wrong answer scores `format_score` (0 by default).

Where this differs from veRL's `gsm8k.py` (current veRL; TinyZero's older copy takes the first
"####" match, not the last):
1. Only the last 10,000 characters are searched (veRL clips to 300): the answer sits at the end,
   and a 10 MB response then costs no more than a short one.
2. flexible drops commas and trailing dots from the number ("1,234." gives "1234"); veRL compares
   the raw run, so "... is 42." scores 0 there.
3. The ground truth is stripped of commas and "$" before the comparison (veRL uses it as given;
   the gsm8k preprocessing writes plain numbers, so the two agree on its data).
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "score_details", "extract_solution"]

_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE_RE = re.compile(r"(\-?[0-9\.\,]+)")
_METHODS = ("strict", "flexible")
_CLIP_CHARS = 10_000


def _normalize(answer: str) -> str:
    return answer.replace(",", "").replace("$", "").strip()


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string by `method`, or None when the response holds none."""
    if method not in _METHODS:
        raise ValueError(f"gsm8k: method must be one of {_METHODS}, got {method!r}")
    solution_str = solution_str[-_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT_RE.findall(solution_str)
        return _normalize(found[-1]) if found else None
    candidate = next((t for t in reversed(_FLEXIBLE_RE.findall(solution_str)) if t not in ("", ".")), None)
    if candidate is None:
        return None
    candidate = _normalize(candidate).rstrip(".")
    return candidate or None


def score_details(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> dict:
    """{"score", "acc", "formatted"} for one response."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return {"score": 0.0, "acc": False, "formatted": False}
    if answer == _normalize(str(ground_truth)):
        return {"score": float(score), "acc": True, "formatted": True}
    return {"score": float(format_score), "acc": False, "formatted": True}


def compute_score(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """GSM8K score of one response."""
    return score_details(solution_str, ground_truth, method, format_score, score)["score"]
