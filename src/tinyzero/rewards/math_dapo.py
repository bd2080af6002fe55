"""veRL's DAPO math scorer (data_source math, math_dapo, math_dapo_reasoning, aime*): +1 / -1 with acc and pred.

The rule of veRL's `verl/utils/reward_score/math_dapo.py` (Minerva's answer normalisation):

1. Only the last 300 characters of the response are read.
2. The answer is the text after the last match of `(?i)Answer\\s*:\\s*` up to the end of its line
   ("[INVALID]" when there is none). Matches do not overlap, so on a line "Answer: 3. Answer: 4"
   the answer is "3. Answer: 4".
3. Answer and ground truth are normalised alike (`normalize_final_answer`): the text after the last
   "="; substitutions ("an " / "a " removed, ".$" -> "$", "\\$", "\\ " and spaces removed, mbox ->
   text, \\text{and} -> ","); unit words and marks removed (square, ways, dollars, mph, cm, degrees,
   \\text{}, ^\\circ, "{,}", ...); $...$ kept inside; \\text{x}, \\textbf{x}, \\overline{x},
   \\boxed{x} unwrapped; \\fracab -> \\frac{a}{b}, \\sqrta -> \\sqrt{a}; "$" dropped; "1,000" ->
   "1000" when only digits and commas remain; stripped.
4. {"score": 1.0, "acc": True, "pred": <normalised answer>} when the two strings are equal, else
   score -1.0 and acc False.

`strict_box_verify=True` (veRL's option, not used by its default_compute_score) instead compares the
last \\boxed{...} in the last 100 characters with the raw ground truth.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "normalize_final_answer", "last_boxed_only_string", "remove_boxed"]

_WINDOW = 300
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)
_REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


def normalize_final_answer(answer: str) -> str:
    """Minerva's normalisation of a final answer (rule 3 of the module docstring)."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    for pattern, repl in _REWRITES:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed_only_string(text: str) -> str | None:
    """The last "\\boxed{...}" with balanced braces, or None."""
    idx = text.rfind("\\boxed{")
    if idx < 0:
        return None
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx:i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """The content of "\\boxed{...}"."""
    return boxed[len("\\boxed{"):-1]


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict:
    """veRL's DAPO score of one response: {"score": +1.0 | -1.0, "acc": bool, "pred": str | None}."""
    solution_str = solution_str[-_WINDOW:]
    if strict_box_verify:
        if pause_tokens_index is not None:
            if len(pause_tokens_index) != 4:
                raise ValueError(f"math_dapo: pause_tokens_index must hold 4 indices, got {pause_tokens_index}")
            tail = solution_str[pause_tokens_index[-1] - 100:]
        else:
            tail = solution_str[-100:]
        boxed = last_boxed_only_string(tail)
        pred = remove_boxed(boxed) if boxed is not None else None
        correct = pred == ground_truth
    else:
        found = _ANSWER_RE.findall(solution_str)
        pred = normalize_final_answer(found[-1] if found else "[INVALID]")
        correct = pred == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
