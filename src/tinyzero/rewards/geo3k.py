"""veRL's Geometry3K scorer (data_source hiyouga/geometry3k): 0.9 x accuracy + 0.1 x format.

The rule of veRL's `verl/utils/reward_score/geo3k.py` (mathruler's grader):

- format (1 or 0): the whole response reads "<think>...</think>...\\boxed{...}..." (the response starts
  with "<think>", a "</think>" follows, then "\\boxed{", then a "}"; anything may sit between).
- accuracy (1 or 0): the content of the last "\\boxed{" up to its balanced "}", stripped (the string
  "None" when there is none), graded against the ground truth by `prm800k.grade_answer` in mathruler's
  variant (a plain "%" is dropped, spaces and braces are dropped after LaTeX rendering; see prm800k
  for what of the symbolic grading is covered).
- score = (1 - format_score) x accuracy + format_score x format, with format_score 0.1.
"""

from __future__ import annotations

from tinyzero.rewards.prm800k import grade_answer

__all__ = ["compute_score", "format_reward", "acc_reward", "extract_boxed_content"]


def format_reward(predict_str: str) -> float:
    """1.0 when the response has the <think>...</think>...\\boxed{...} shape, else 0.0."""
    if not predict_str.startswith("<think>"):
        return 0.0
    close = predict_str.find("</think>", len("<think>"))
    if close < 0:
        return 0.0
    boxed = predict_str.find("\\boxed{", close + len("</think>"))
    if boxed < 0:
        return 0.0
    return 1.0 if predict_str.find("}", boxed + len("\\boxed{")) >= 0 else 0.0


def extract_boxed_content(text: str) -> str:
    """mathruler's extraction: the stripped content of the last "\\boxed{...}", or the string "None"."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return "None"
    depth = 0
    content = text[start + len("\\boxed{"):]
    for i, c in enumerate(content):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == -1:
                return content[:i].strip()
    return "None"


def acc_reward(predict_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    """1.0 when the (boxed) answer grades equal to the ground truth, else 0.0."""
    answer = extract_boxed_content(predict_str) if use_boxed else predict_str
    return 1.0 if grade_answer(answer, ground_truth, "mathruler") else 0.0


def compute_score(predict_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1) -> float:
    """veRL's Geometry3K score of one response."""
    return (1.0 - format_score) * acc_reward(predict_str, ground_truth, use_boxed) + format_score * format_reward(
        predict_str)
