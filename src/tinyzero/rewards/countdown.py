"""Countdown reward: TinyZero's scoring rules with a bounded evaluator instead of `eval`.

Scores (TinyZero defaults): 0 when no `<answer>...</answer>` is found, `format_score`
(0.1) when an answer is found but is not a valid equation using every given number
exactly once that evaluates to the target, and `score` (1.0) when |value - target| < 1e-5.

TinyZero decoded prompt + response, cut everything before the first "Assistant:" (or
"<|im_start|>assistant") and searched only the last line of what followed. Its prompts end
in a line "<think>" that holds no answer tags, so scoring the response text alone, as
`RewardManager` does, gives the same score. `last_line_only=False` searches the whole
response instead.

Bounded time on adversarial text: tags are found with a linear scan (no backtracking
regex), the equation is length-checked before anything else, and the evaluator rejects
long numbers, deep nesting and `**`.
"""

from __future__ import annotations

import re

from tinyzero.rewards.safe_eval import MAX_DIGITS, MAX_LENGTH, try_safe_eval

__all__ = ["compute_score", "score_details", "extract_solution", "validate_equation", "find_last_tagged"]

_OPEN, _CLOSE = "<answer>", "</answer>"
_NUMBER_RE = re.compile(r"\d+")


def find_last_tagged(text: str, open_tag: str = _OPEN, close_tag: str = _CLOSE) -> str | None:
    """Content of the last non-overlapping open_tag...close_tag pair, scanning left to right.

    Equivalent to the last match of the regex `open(.*?)close` (with `.` matching anything
    but a newline when the caller passes a single line), but linear in len(text).
    """
    last = None
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            break
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            break
        last = (start + len(open_tag), end)
        pos = end + len(close_tag)
    if last is None:
        return None
    return text[last[0]:last[1]]


def extract_solution(solution_str: str, last_line_only: bool = True) -> str | None:
    """The stripped content of the last <answer> tag (in the last line by default), or None."""
    if last_line_only:
        solution_str = solution_str[solution_str.rfind("\n") + 1:]
    content = find_last_tagged(solution_str)
    return None if content is None else content.strip()


def validate_equation(equation: str, numbers) -> bool:
    """Every available number is used exactly once (as a multiset) and nothing else."""
    if len(equation) > MAX_LENGTH:
        return False
    found = _NUMBER_RE.findall(equation)
    if any(len(n) > MAX_DIGITS for n in found):
        return False
    try:
        return sorted(int(n) for n in found) == sorted(int(n) for n in numbers)
    except (TypeError, ValueError):
        return False


def score_details(solution_str: str, ground_truth, format_score: float = 0.1, score: float = 1.0,
                  last_line_only: bool = True) -> dict:
    """{"score", "acc", "formatted"} for one response; see the module docstring."""
    target = ground_truth["target"]
    numbers = ground_truth["numbers"]
    equation = extract_solution(solution_str, last_line_only=last_line_only)
    if equation is None:
        return {"score": 0.0, "acc": False, "formatted": False}
    wrong = {"score": float(format_score), "acc": False, "formatted": True}
    if not validate_equation(equation, numbers):
        return wrong
    value = try_safe_eval(equation)
    if value is None:
        return wrong
    try:
        correct = abs(value - target) < 1e-5
    except (TypeError, OverflowError):
        return wrong
    if not correct:
        return wrong
    return {"score": float(score), "acc": True, "formatted": True}


def compute_score(solution_str: str, ground_truth, format_score: float = 0.1, score: float = 1.0,
                  last_line_only: bool = True, method: str = "strict") -> float:
    """TinyZero's countdown score of one response (ground_truth = {"target", "numbers"})."""
    del method  # accepted for TinyZero call compatibility; countdown has one extraction method
    return score_details(solution_str, ground_truth, format_score, score, last_line_only)["score"]
