"""prm800k's answer grader (`grade_answer`), as veRL's prime_math and mathruler (geo3k) use it, without sympy.

grade_answer(given, ground_truth) is True when
(a) the two are equal after `hendrycks.normalize_answer`, or
(b) equal after `normalize_expr` (below), or
(c) they split into the same number of tuple / interval elements (same brackets) and every pair of
    elements is equivalent: two plain fractions "a/b" must be written the same (unreduced fractions
    are wrong); an integer against a non-integer is wrong; otherwise the two must have the same value.

normalize_expr: an enclosing \\text{} unwrapped; "\\%", "%", "\\$", "$" dropped; " or " / " and " ->
" , "; million / billion / trillion -> *10^6 / ^9 / ^12; unit words (degree, cm, meter, mile, second,
minute, hour, day, week, month, year, foot, feet, inch, yard, and liter in the prime variant, with
plurals and a ^n) and ^\\circ dropped; one pair of enclosing braces dropped; ",\\!" dropped; a float
that is an integer -> that integer; LaTeX rendered as text (below); "- " -> "-"; "7 3/4" -> "7+3/4";
(mathruler: spaces and braces dropped); lower-cased; an integer with well-formed thousands commas
-> the integer.

Where this differs from the reference, which runs pylatexenc and sympy on the text:
- LaTeX to text covers \\frac / \\dfrac / \\tfrac (as "a/b", or "(A)/(B)" for compound parts),
  \\sqrt{x} (as "sqrt(x)"), \\pi, \\infty, \\cdot, \\times, \\cup, \\left / \\right, \\text / \\mathrm /
  \\textbf / \\mathbf, spacing macros and braces. Text holding any other macro is left as it was
  (pylatexenc would render it, e.g. Greek letters as Unicode).
- "Same value" (sympy.simplify of the difference is 0) is decided for expressions of numbers,
  + - * / and parentheses (after the LaTeX rendering), in exact rational arithmetic; when a decimal
  takes part, in double precision (sympy rounds a rational to the precision of the float it meets).
  Not covered, so graded not equivalent: powers (^), roots, pi, variables, implicit products ("2(3)"),
  functions -- sympy would prove e.g. "2\\sqrt{2}" equal to "\\sqrt{8}" or "x+1" equal to "1+x".
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

from tinyzero.rewards.hendrycks import normalize_answer
from tinyzero.rewards.safe_eval import SafeEvalError, safe_eval

__all__ = ["grade_answer", "normalize_expr", "latex_to_text", "same_value", "split_tuple", "strip_thousands_commas"]

GraderVariant = Literal["prime", "mathruler"]

_TEXT_RE = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard")
_UNIT_RES = {v: [re.compile(f"{u}(es)?(s)? *(\\^[0-9]+)?") for u in _UNITS + (("liter",) if v == "prime" else ())]
             for v in ("prime", "mathruler")}
_CIRC_RE = re.compile(r"\^ *\\circ")
_THIN_SPACE_RE = re.compile(",\\\\! *")
_MINUS_RE = re.compile("- *")
_MIXED_RE = re.compile("([0-9]) +([0-9])")
_COMMAS_RE = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_FRAC_RE = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_TUPLE_CHARS = "()[]"
_SIMPLE_ARG_RE = re.compile(r"^[0-9A-Za-z.]+$")
_MACRO_TEXT = {"pi": "pi", "infty": "inf", "cdot": "*", "times": "*", "cup": "U", "left": "", "right": "",
               ",": " ", ";": " ", ":": " ", " ": " ", "!": "", "quad": " ", "qquad": " ", "%": "%", "$": "$"}
_MACRO_ARG = ("text", "mathrm", "textbf", "mathbf", "textrm", "mbox")


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):
        return False


def strip_thousands_commas(expr: str) -> str:
    """'1,234,567' -> '1234567'; commas of tuples ('(1,2)') stay."""
    while True:
        nxt = _COMMAS_RE.sub("\\1\\3\\4", expr)
        if nxt == expr:
            return nxt
        expr = nxt


def _str_is_int(text: str) -> bool:
    try:
        return _is_int(float(strip_thousands_commas(text)))
    except ValueError:
        return False


def _group(text: str, start: int) -> tuple[str, int] | None:
    """The content of the {...} group at text[start] and the index after it; None if unbalanced."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def latex_to_text(expr: str) -> str | None:
    """The plain-text rendering of a LaTeX answer (see the module docstring), or None when it holds a
    macro outside the covered set (the caller keeps the text as it was)."""
    out, i, n = [], 0, len(expr)
    while i < n:
        c = expr[i]
        if c == "{" or c == "}":
            i += 1
            continue
        if c != "\\":
            out.append(c)
            i += 1
            continue
        j = i + 1
        while j < n and expr[j].isalpha():
            j += 1
        name = expr[i + 1:j] if j > i + 1 else expr[i + 1:i + 2]
        end = j if j > i + 1 else i + 2
        if name in ("frac", "dfrac", "tfrac"):
            num = _group(expr, end)
            den = _group(expr, num[1]) if num else None
            if den is None:
                return None
            a, b = latex_to_text(num[0]), latex_to_text(den[0])
            if a is None or b is None:
                return None
            a, b = a.strip(), b.strip()
            simple = _SIMPLE_ARG_RE.match(a) and _SIMPLE_ARG_RE.match(b)
            out.append(f" {a}/{b}" if simple else f" ({a})/({b})")
            i = den[1]
        elif name == "sqrt":
            arg = _group(expr, end)
            inner = latex_to_text(arg[0]) if arg else None
            if inner is None:
                return None
            out.append(f"sqrt({inner})")
            i = arg[1]
        elif name in _MACRO_ARG:
            arg = _group(expr, end)
            inner = latex_to_text(arg[0]) if arg else None
            if inner is None:
                return None
            out.append(inner)
            i = arg[1]
        elif name in _MACRO_TEXT:
            out.append(_MACRO_TEXT[name])
            i = end
        else:
            return None
    return "".join(out).strip()


def normalize_expr(expr: str | None, variant: GraderVariant = "prime") -> str | None:
    """prm800k's `_normalize` of an answer expression (see the module docstring)."""
    if expr is None:
        return None
    m = _TEXT_RE.search(expr)
    if m is not None:
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit_re in _UNIT_RES[variant]:
        expr = unit_re.sub("", expr)
    expr = _CIRC_RE.sub("", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = _THIN_SPACE_RE.sub("", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        text = latex_to_text(expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac"))
        if text is not None:
            expr = text
    expr = _MINUS_RE.sub("-", expr)
    expr = _MIXED_RE.sub("\\1+\\2", expr)
    if variant == "mathruler":
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _value(expr: str) -> tuple[Fraction, bool] | None:
    """(exact value, whether a decimal takes part) of a +-*/ expression, or None."""
    try:
        value = safe_eval(expr, exact=True)
    except SafeEvalError:
        return None
    return Fraction(value), "." in expr


def same_value(a: str, b: str) -> bool:
    """Whether two expressions of numbers and + - * / ( ) have the same value (see the module docstring)."""
    va, vb = _value(a), _value(b)
    if va is None or vb is None:
        return False
    if va[1] or vb[1]:
        try:
            return float(va[0]) == float(vb[0])
        except OverflowError:
            return False
    return va[0] == vb[0]


def split_tuple(expr: str) -> list[str]:
    """The elements of a tuple / interval "(a, b)" / "[a, b)" (thousands commas kept in numbers)."""
    expr = strip_thousands_commas(expr)
    if not expr:
        return []
    if (len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS
            and all(ch not in expr[1:-1] for ch in _TUPLE_CHARS)):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def grade_answer(given: str | None, ground_truth: str, variant: GraderVariant = "prime") -> bool:
    """prm800k's grade_answer (see the module docstring)."""
    if given is None:
        return False
    hendrycks_variant = "mathruler" if variant == "mathruler" else "prm800k"
    if normalize_answer(ground_truth, hendrycks_variant) == normalize_answer(given, hendrycks_variant):
        return True
    truth, answer = normalize_expr(ground_truth, variant), normalize_expr(given, variant)
    if truth is None:
        return False
    if truth == answer:
        return True
    if not answer:
        return False
    truth_elems, answer_elems = split_tuple(truth), split_tuple(answer)
    if len(truth_elems) > 1 and (truth[0] != answer[0] or truth[-1] != answer[-1]):
        return False
    if len(truth_elems) != len(answer_elems):
        return False
    for t, a in zip(truth_elems, answer_elems):
        if _FRAC_RE.search(t) and _FRAC_RE.search(a):
            ok = t == a  # an unreduced fraction is not the answer
        elif _str_is_int(t) != _str_is_int(a):
            ok = False  # an integer answer must match as a string (no symbolic equality)
        else:
            ok = same_value(t, a)
        if not ok:
            return False
    return True
