"""MATH-style reward: the last \\boxed{...} answer, compared after light LaTeX normalization.

Extraction takes the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed x`) with balanced
braces. Normalization (the usual MATH equivalence rules): drop whitespace, `\\left`/`\\right`,
`\\!`, `$`, degree marks, `\\%`, a trailing `\\text{ unit}`, a short "x =" prefix and a
trailing "."; `dfrac`/`tfrac` -> `frac`; `\\frac12` -> `\\frac{1}{2}`; `\\sqrt2` -> `\\sqrt{2}`;
`a/b` of two integers -> `\\frac{a}{b}`; "0.5" -> `\\frac{1}{2}`; a leading "." gains a "0".
Score 1.0 when the normalized strings are equal, `format_score` (0) when a boxed answer was
found but differs, 0 when there is none. Only the last 10,000 characters are searched.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "score_details", "last_boxed_content", "normalize_answer", "is_equiv"]

_CLIP_CHARS = 10_000
_SLASH_RE = re.compile(r"^(-?[0-9]+)/([0-9]+)$")


def last_boxed_content(text: str) -> str | None:
    """The content of the last \\boxed{...} / \\fbox{...} / "\\boxed x" in text, or None."""
    text = text[-_CLIP_CHARS:]
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    name_end = idx + (6 if text.startswith("\\boxed", idx) else 5)
    rest = text[name_end:]
    if rest.startswith(" "):
        # "\boxed 5$" style: up to the next "$" or end.
        return rest[1:].split("$", 1)[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, c in enumerate(rest):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if not part or part[0] == "{":
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, tail = part[0], part[1], part[2:]
        if b == "{":
            out += "{" + a + "}" + b + tail
        else:
            out += "{" + a + "}{" + b + "}" + tail
    return out


def _fix_sqrt(s: str) -> str:
    parts = s.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        if part and part[0] != "{":
            out += "\\sqrt{" + part[0] + "}" + part[1:]
        else:
            out += "\\sqrt" + part
    return out


def normalize_answer(s: str) -> str:
    """Canonical form of a MATH answer string (see the module docstring)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    if "\\text{ " in s:
        s = s.split("\\text{ ", 1)[0]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:
        s = s.split("=")[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    s = s.rstrip(".")
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = _SLASH_RE.match(s)
    if m:
        s = "\\frac{" + m.group(1) + "}{" + m.group(2) + "}"
    return s


def is_equiv(a: str | None, b: str | None) -> bool:
    """Equal after normalization; None is never equivalent to anything."""
    if a is None or b is None:
        return False
    return normalize_answer(a) == normalize_answer(b)


def score_details(solution_str: str, ground_truth, format_score: float = 0.0, score: float = 1.0) -> dict:
    """{"score", "acc", "formatted"} for one response."""
    answer = last_boxed_content(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": False, "formatted": False}
    truth = str(ground_truth)
    boxed_truth = last_boxed_content(truth)
    if boxed_truth is not None:
        truth = boxed_truth
    if is_equiv(answer, truth):
        return {"score": float(score), "acc": True, "formatted": True}
    return {"score": float(format_score), "acc": False, "formatted": True}


def compute_score(solution_str: str, ground_truth, format_score: float = 0.0, score: float = 1.0) -> float:
    """MATH score of one response."""
    return score_details(solution_str, ground_truth, format_score, score)["score"]
