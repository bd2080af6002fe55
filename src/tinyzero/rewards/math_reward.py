"""veRL's MATH scorer (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500): 1.0 / 0.0.

The rule of veRL's `verl/utils/reward_score/math_reward.py` (lm-eval-harness's hendrycks_math):

1. The answer: when the response holds "\\boxed " (with a space) anywhere, the text after the last
   "\\boxed " up to the next "$"; otherwise the last "\\boxed" (or, with no "\\boxed" at all, the last
   "\\fbox") through the "}" that closes the first "{" after it, which must read "\\boxed{...}":
   a "\\fbox{...}", "\\boxedx{...}" or unclosed brace scores 0. The whole response is searched.
2. The answer equals the ground truth (as given, never unboxed) after `hendrycks.strip_string`;
   where that normalisation is malformed for either side, the raw strings are compared instead.
   A ground truth that is not a string matches nothing.
"""

from __future__ import annotations

from tinyzero.rewards.hendrycks import Malformed, strip_string

__all__ = ["compute_score", "last_boxed_only_string", "remove_boxed", "is_equiv"]


def last_boxed_only_string(text: str) -> str | None:
    """The last boxed expression as veRL's math_reward finds it (see the module docstring), or None."""
    if "\\boxed " in text:
        return "\\boxed " + text.rsplit("\\boxed ", 1)[1].split("$", 1)[0]
    idx = text.rfind("\\boxed")
    if idx < 0:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    depth = 0
    for i in range(idx, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[idx:i + 1]
    return None


def remove_boxed(boxed: str) -> str | None:
    """The content of "\\boxed x" or "\\boxed{x}"; None for anything else (veRL's assertion fails)."""
    if "\\boxed " in boxed:
        return boxed[len("\\boxed "):] if boxed.startswith("\\boxed ") else None
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{"):-1]
    return None


def is_equiv(a, b) -> bool:
    """Equal after strip_string; the raw values compared where the normalisation is malformed."""
    if a is None and b is None:
        return True
    if a is None or b is None:
        return False
    try:
        return strip_string(a) == strip_string(b)
    except Malformed:
        return a == b


def compute_score(solution_str: str, ground_truth) -> float:
    """veRL's MATH score of one response: 1.0 when the boxed answer is equivalent, else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    answer = remove_boxed(boxed)
    if answer is None:
        return 0.0
    return 1.0 if is_equiv(answer, ground_truth) else 0.0
