"""veRL's PRIME math scorer (data_source numina_aops_forum, numina_synthetic_math, numina_amc_aime,
numina_synthetic_amc, numina_cn_k12, numina_olympiads): 1.0 / 0.0.

The rule of veRL's `verl/utils/reward_score/prime_math/__init__.py` (scored as float(result[0])):

1. The answer (`match_answer`): after the last "answer:", then "answer is", then "answers are"
   (case-insensitive, each searched in what the previous cut left); before the last "is answer",
   "is the answer", "are answers", "are the answers"; then the content of the last \\boxed{...} /
   \\fbox{...} when it is not empty; then cut at the last ". "; then after the last of "be ", "is ",
   "are ", "=", ": ", "get " (and their newline forms), each in turn.
2. Correct when `prm800k.grade_answer(answer, ground_truth)` holds, or else when `math_equal` does:
   "$5" -> "5"; "5%" -> "5"; "12_3" (a base) -> 12; strings equal ignoring case or spaces; two numbers
   (commas dropped) equal within rel 1e-4 to the ground truth, or to it x 100 or / 100; brackets
   stripped and braces / parentheses dropped, equal; [a, b] vs [c, d] or "a, b" vs "c, d" element by
   element; "Point(a, b)" vs "(a, b)"; else the same value. With \\pi on either side, pi is tried as
   math.pi and as 3.14.

Where this differs from the reference, which runs sympy's parse_expr / parse_latex and `eval` on model
output: see `prm800k` for the value comparison and the LaTeX covered. Here, in math_equal: \\pi is
replaced as the reference does and the result evaluated only as + - * / arithmetic; the reference's
matrix comparisons (parse_expr / eval of "Matrix(...)" and "[[...]]") are not done (such answers are
wrong unless equal as strings); sympy's numeric fallback N(a) ~ N(b) is the same value comparison
within rel 1e-4.
"""

from __future__ import annotations

import math
import re

from tinyzero.rewards.prm800k import grade_answer, latex_to_text
from tinyzero.rewards.safe_eval import try_safe_eval

__all__ = ["compute_score", "match_answer", "math_equal"]

_DOLLAR_NUM_RE = re.compile(r"\$\d+(\.\d+)?")
_PERCENT_RES = (re.compile(r"^\d+(\.\d+)?%$"), re.compile(r"^\d+(\.\d+)?\\%$"))
_INTERVALS = ((re.compile(r"^Interval\((.*)\)$"), "[", "]"), (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[", ")"),
              (re.compile(r"^Interval\.Lopen\((.*)\)$"), "(", "]"), (re.compile(r"^Interval\.open\((.*)\)$"), "(", ")"))


def _last_boxed_content(text: str) -> str | None:
    idx = text.rfind("\\boxed")
    if idx < 0:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    left, depth = None, 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
            if left is None:
                left = i
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[left + 1:i].strip() if left is not None else None
    return None


def _after_last(text: str, markers) -> str:
    for marker in markers:
        idx = text.lower().rfind(marker)
        if idx != -1:
            text = text[idx + len(marker):].strip()
    return text


def match_answer(response: str) -> str:
    """The answer the PRIME scorer reads from a response (rule 1 of the module docstring)."""
    response = _after_last(response, ("answer:", "answer is", "answers are"))
    for marker in ("is answer", "is the answer", "are answers", "are the answers"):
        idx = response.lower().rfind(marker)
        if idx != -1:
            response = response[:idx].strip()
    boxed = _last_boxed_content(response)
    if boxed:
        response = boxed
    if ". " in response:
        response = response[:response.lower().rfind(". ")].strip()
    return _after_last(response, ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n"))


def _to_number(value) -> float | None:
    """is_digit: a float from a number or a string ("{,}" or "," dropped), else None."""
    text = str(value)
    try:
        return float(text.replace("{,}", "")) if "{,}" in text else float(text.replace(",", ""))
    except ValueError:
        return None


def _prepare(answer, pi: float):
    """math_equal's `normalize`: "$5" -> "5", "5%" -> "5", a base suffix dropped, \\pi substituted."""
    if isinstance(answer, str) and _DOLLAR_NUM_RE.match(answer):
        return answer[1:]
    if isinstance(answer, str) and any(r.match(answer) for r in _PERCENT_RES):
        return answer.replace("\\%", "").replace("%", "")
    if isinstance(answer, str) and "_" in answer:
        return int(float(answer.split("_")[0]))  # ValueError (not a number) makes the answer wrong
    if isinstance(answer, str) and "\\pi" in answer:
        idx = answer.find("\\pi")
        while idx != -1:
            factor = "*" if idx > 0 and answer[idx - 1].isdigit() else "1*"
            answer = answer[:idx] + f"{factor}{pi}" + answer[idx + 3:]
            idx = answer.find("\\pi", idx + 1)
        value = try_safe_eval(answer)
        return answer if value is None else value
    return answer


def _value_close(a: str, b: str, tolerance: float) -> bool:
    """The reference's symbolic_equal: the same value (exactly, or within rel `tolerance`)."""
    values = []
    for s in (a, b):
        v = try_safe_eval(s, exact=True)
        if v is None and "\\" in s:
            text = latex_to_text(s)
            v = try_safe_eval(text, exact=True) if text is not None else None
        if v is None:
            return False
        values.append(v)
    if values[0] == values[1]:
        return True
    try:
        return math.isclose(float(values[0]), float(values[1]), rel_tol=tolerance)
    except OverflowError:
        return False


def math_equal(prediction, reference, include_percentage: bool = True, tolerance: float = 1e-4,
               pi: float = math.pi) -> bool:
    """The reference's math_equal (rule 2 of the module docstring, after grade_answer)."""
    prediction, reference = _prepare(prediction, pi), _prepare(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    p_num, r_num = _to_number(prediction), _to_number(reference)
    if p_num is not None and r_num is not None:
        candidates = [r_num / 100, r_num, r_num * 100] if include_percentage else [r_num]
        return any(math.isclose(c, p_num, rel_tol=tolerance) for c in candidates)
    if not prediction and prediction not in (0, False):
        return False
    reference, prediction = str(reference).strip(), str(prediction).strip()
    for pattern, left, right in _INTERVALS:
        m = pattern.match(prediction)
        if m:
            prediction = f"{left}{m.group(1)}{right}"
            break
    pred_str, ref_str = prediction, reference
    if ((prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("("))
            or (prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("["))):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    for ch in "{}()":
        pred_str, ref_str = pred_str.replace(ch, ""), ref_str.replace(ch, "")
    if pred_str == ref_str:
        return True
    if (prediction and reference and prediction[0] in "([" and prediction[-1] in ")]"
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]):
        p_parts, r_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(p_parts) == len(r_parts) and all(
                math_equal(p, r, include_percentage, tolerance) for p, r in zip(p_parts, r_parts)):
            return True
    if "," in prediction and "," in reference:
        p_parts = [p.strip() for p in prediction.split(",")]
        r_parts = [r.strip() for r in reference.split(",")]
        if len(p_parts) == len(r_parts):
            return all(math_equal(p, r, include_percentage, tolerance) for p, r in zip(p_parts, r_parts))
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        p_parts = prediction[prediction.find("(") + 1:-1].split(",")
        r_parts = reference[1:-1].split(",")
        if len(p_parts) == len(r_parts) and all(
                math_equal(p, r, include_percentage, tolerance) for p, r in zip(p_parts, r_parts)):
            return True
    return _value_close(prediction, reference, tolerance)


def compute_score(model_output: str, ground_truth) -> float:
    """veRL's PRIME math score of one response: 1.0 when the answer is judged equal, else 0.0."""
    model_output, ground_truth = str(model_output), str(ground_truth)
    answer = match_answer(model_output)
    if grade_answer(answer, ground_truth, "prime"):
        return 1.0
    try:
        if "\\pi" in answer or "\\pi" in ground_truth:
            correct = any(math_equal(answer, ground_truth, pi=pi) for pi in (math.pi, 3.14))
        else:
            correct = math_equal(answer, ground_truth)
    except (ValueError, OverflowError, IndexError):  # the reference counts any failure as a wrong answer
        correct = False
    return 1.0 if correct else 0.0
