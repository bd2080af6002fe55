"""Arithmetic / multiply reward: TinyZero's integer-answer rule, plus a plain mode for short tasks.

tagged (TinyZero "multiply" / "arithmetic"): the last <answer>...</answer> in the response
must hold an integer; 1.0 if it equals the ground truth, `format_score` (0.1) if it is some
other integer, 0 if there is no tag or the content is not an integer.

plain (the CPU demo task "12+7=" -> "19"): the response, stripped, must begin with an integer
that is followed by whitespace or nothing; the same 1.0 / format_score / 0 rule applies.
Rows pick plain mode with extra_info["answer_format"] = "plain".
"""

from __future__ import annotations

import re

from tinyzero.rewards.countdown import find_last_tagged

__all__ = ["compute_score", "score_details", "extract_solution", "ANSWER_FORMATS"]

ANSWER_FORMATS = ("tagged", "plain")
_INT_RE = re.compile(r"[+-]?[0-9]{1,64}")
_PLAIN_RE = re.compile(r"([+-]?[0-9]{1,64})(?:\s|$)")


def _parse_int(text: str) -> int | None:
    text = text.strip()
    if not _INT_RE.fullmatch(text):
        return None
    return int(text)


def extract_solution(solution_str: str, answer_format: str = "tagged") -> int | None:
    """The integer answer of a response, or None when there is none in the expected format."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"arithmetic: answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    if answer_format == "plain":
        m = _PLAIN_RE.match(solution_str.lstrip())
        return int(m.group(1)) if m else None
    content = find_last_tagged(solution_str)
    return None if content is None else _parse_int(content)


def score_details(solution_str: str, ground_truth, format_score: float = 0.1, score: float = 1.0,
                  answer_format: str = "tagged") -> dict:
    """{"score", "acc", "formatted"} for one response."""
    answer = extract_solution(solution_str, answer_format)
    if answer is None:
        return {"score": 0.0, "acc": False, "formatted": False}
    if answer == int(str(ground_truth).strip()):
        return {"score": float(score), "acc": True, "formatted": True}
    return {"score": float(format_score), "acc": False, "formatted": True}


def compute_score(solution_str: str, ground_truth, format_score: float = 0.1, score: float = 1.0,
                  answer_format: str = "tagged", method: str = "strict") -> float:
    """Score of one arithmetic response against an integer ground truth."""
    del method  # accepted for TinyZero call compatibility
    return score_details(solution_str, ground_truth, format_score, score, answer_format)["score"]
