"""The MATH answer normalisation of Hendrycks et al., in the three variants veRL's scorers use.

`strip_string(s, variant)` turns an answer into a canonical string, step by step:

    drop newlines and "\\!"; "\\\\" -> "\\"; tfrac / dfrac -> frac; drop \\left, \\right, ^{\\circ}, ^\\circ, "\\$";
    cut at "\\text{ " (a unit on the right; two of them are malformed); drop "\\%" (and "%" in the
    "mathruler" variant); " ." -> " 0.", "{." -> "{0.", a leading "." gains a "0"; "k = 5" -> "5" when
    the part before the only "=" has at most 2 characters; \\sqrt3 -> \\sqrt{3}; drop spaces;
    \\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}; "0.5" -> \\frac{1}{2}; "3/4" -> \\frac{3}{4}.

Where the reference code raises on a malformed answer (two "\\text{ " units, a "\\sqrt" or "\\frac"
with nothing after it), `strip_string` raises `Malformed`; each caller applies its own fallback, as
veRL does: math_reward compares the raw strings, prm800k / mathruler keep the half-normalised text.

Variants: "hendrycks" (veRL's math_reward.py, lm-eval-harness), "prm800k" (veRL's
prime_math/math_normalize.py), "mathruler" (mathruler's math_normalize.py, used by geo3k; it also
drops a plain "%").
"""

from __future__ import annotations

import re
from typing import Literal

__all__ = ["Malformed", "strip_string", "normalize_answer", "Variant"]

Variant = Literal["hendrycks", "prm800k", "mathruler"]

_TEXT_RE = re.compile(r"^\\text\{(?P<text>.+?)\}$")


class Malformed(ValueError):
    """An answer on which the reference normalisation raises (the caller applies its fallback)."""


def _remove_right_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise Malformed("more than one '\\text{ ' unit")
    return parts[0]


def _fix_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    parts = s.split("\\sqrt")
    out = [parts[0]]
    for part in parts[1:]:
        if not part:
            raise Malformed("'\\sqrt' with nothing after it")
        out.append("\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:])
    return "".join(out)


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = [parts[0]]
    for part in parts[1:]:
        out.append("\\frac")
        if not part:
            raise Malformed("'\\frac' with nothing after it")
        if part[0] == "{":
            out.append(part)
            continue
        if len(part) < 2:
            return s  # "\frac1" at the end: the reference gives the whole string back unchanged
        a, b, rest = part[0], part[1], part[2:]
        out.append("{" + a + "}" + b + rest if b == "{" else "{" + a + "}{" + b + "}" + rest)
    return "".join(out)


def _fix_a_slash_b(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    if s != f"{a}/{b}":  # int() also accepts " 3", "+3", "0_3": those stay as they are
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


def strip_string(s: str, variant: Variant = "hendrycks") -> str:
    """The canonical form of a MATH answer (see the module docstring); raises Malformed."""
    if not isinstance(s, str):
        raise Malformed(f"not a string: {type(s).__name__}")
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _remove_right_units(s)
    if variant == "mathruler":
        s = s.replace("\\%", "").replace("%", "")
    else:
        s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def normalize_answer(answer: str | None, variant: Variant = "prm800k") -> str | None:
    """prm800k's / mathruler's normalize_answer: strip, drop an enclosing \\text{...}, then strip_string;
    on a malformed answer the text as it stood before strip_string."""
    if answer is None:
        return None
    answer = answer.strip()
    m = _TEXT_RE.search(answer)
    if m is not None:
        answer = m.group("text").strip()
    try:
        return strip_string(answer, variant)
    except Malformed:
        return answer
