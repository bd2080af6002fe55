"""A bounded arithmetic evaluator for model-written equations (never `eval`).

Grammar (the subset of Python expressions a countdown answer may use):

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/" | "//") factor)*
    factor := ("+" | "-")* atom
    atom   := NUMBER | "(" expr ")"
    NUMBER := ASCII digits with an optional "." part ("12", "1.5", "1.", ".5")

Values follow Python's own arithmetic (ints stay ints, "/" is true division, "//" floor
division), so on every expression this grammar accepts the result equals what Python's
`eval` would give. Everything else is rejected with `SafeEvalError`: exponentiation (`**`),
any other character (letters, unicode digits or spaces), juxtaposition such as `2(3)`,
integer literals with leading zeros (Python rejects them too), division by zero, and inputs
beyond the bounds below. The work done is linear in the (bounded) input length.

`exact=True` evaluates in rational arithmetic instead: every literal is a `fractions.Fraction`
("0.1" is exactly 1/10) and "/" stays exact (the math answer graders compare values this way).
"""

from __future__ import annotations

from fractions import Fraction

__all__ = ["SafeEvalError", "safe_eval", "try_safe_eval", "MAX_LENGTH", "MAX_DIGITS", "MAX_DEPTH"]

MAX_LENGTH = 1000
"""Longest expression (characters) that is evaluated at all."""
MAX_DIGITS = 32
"""Most digits a single number literal may have."""
MAX_DEPTH = 32
"""Deepest parenthesis nesting accepted."""
MAX_ABS_INT = 10**400
"""Largest magnitude an intermediate integer may reach (bounds the cost of big-int products)."""

_DIGITS = frozenset("0123456789")
_SPACES = frozenset(" \t\r\n\f\v")
_NUM = "num"


class SafeEvalError(ValueError):
    """The text is not a valid bounded arithmetic expression, or evaluating it failed."""


def _tokenize(text: str, max_digits: int, exact: bool = False) -> list[tuple[str, object]]:
    tokens: list[tuple[str, object]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _SPACES:
            i += 1
            continue
        if c in _DIGITS or c == ".":
            j = i
            while j < n and text[j] in _DIGITS:
                j += 1
            int_part = text[i:j]
            frac_part = None
            if j < n and text[j] == ".":
                k = j + 1
                while k < n and text[k] in _DIGITS:
                    k += 1
                frac_part = text[j + 1:k]
                j = k
            if not int_part and not frac_part:
                raise SafeEvalError(f"stray '.' at position {i}")
            if len(int_part) + len(frac_part or "") > max_digits:
                raise SafeEvalError(f"number at position {i} has more than {max_digits} digits")
            if frac_part is None:
                if len(int_part) > 1 and int_part[0] == "0" and int_part.strip("0"):
                    raise SafeEvalError(f"integer literal with leading zeros at position {i}")
                value: object = Fraction(int(int_part)) if exact else int(int_part)
            else:
                value = Fraction((int_part or "0") + "." + frac_part) if exact else float(text[i:j])
            tokens.append((_NUM, value))
            i = j
            continue
        if c == "*":
            if i + 1 < n and text[i + 1] == "*":
                raise SafeEvalError("exponentiation ('**') is not allowed")
            tokens.append(("*", None))
            i += 1
            continue
        if c == "/":
            if i + 1 < n and text[i + 1] == "/":
                tokens.append(("//", None))
                i += 2
            else:
                tokens.append(("/", None))
                i += 1
            continue
        if c in "+-()":
            tokens.append((c, None))
            i += 1
            continue
        raise SafeEvalError(f"character {c!r} at position {i} is not allowed")
    return tokens


def _check(value):
    if isinstance(value, int) and abs(value) > MAX_ABS_INT:
        raise SafeEvalError("intermediate integer too large")
    if isinstance(value, Fraction) and (abs(value.numerator) > MAX_ABS_INT or value.denominator > MAX_ABS_INT):
        raise SafeEvalError("intermediate fraction too large")
    return value


def _apply(op: str, a, b):
    try:
        if op == "+":
            return _check(a + b)
        if op == "-":
            return _check(a - b)
        if op == "*":
            return _check(a * b)
        if op == "/":
            return _check(a / b)
        return _check(a // b)
    except ZeroDivisionError as e:
        raise SafeEvalError("division by zero") from e
    except OverflowError as e:
        raise SafeEvalError("numeric overflow") from e


class _Parser:
    def __init__(self, tokens: list[tuple[str, object]], max_depth: int):
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.max_depth = max_depth

    def peek(self) -> str | None:
        return self.tokens[self.pos][0] if self.pos < len(self.tokens) else None

    def expr(self):
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.tokens[self.pos][0]
            self.pos += 1
            value = _apply(op, value, self.term())
        return value

    def term(self):
        value = self.factor()
        while self.peek() in ("*", "/", "//"):
            op = self.tokens[self.pos][0]
            self.pos += 1
            value = _apply(op, value, self.factor())
        return value

    def factor(self):
        negate = False
        while self.peek() in ("+", "-"):
            if self.tokens[self.pos][0] == "-":
                negate = not negate
            self.pos += 1
        value = self.atom()
        # Python applies unary minus to the value; for ints and floats that is plain negation.
        return -value if negate else +value

    def atom(self):
        kind = self.peek()
        if kind == _NUM:
            value = self.tokens[self.pos][1]
            self.pos += 1
            return value
        if kind == "(":
            self.depth += 1
            if self.depth > self.max_depth:
                raise SafeEvalError(f"parentheses nested deeper than {self.max_depth}")
            self.pos += 1
            value = self.expr()
            if self.peek() != ")":
                raise SafeEvalError("missing ')'")
            self.pos += 1
            self.depth -= 1
            return value
        raise SafeEvalError(f"expected a number or '(' at token {self.pos}, got {kind!r}")


def safe_eval(text: str, *, max_length: int = MAX_LENGTH, max_digits: int = MAX_DIGITS,
              max_depth: int = MAX_DEPTH, exact: bool = False) -> int | float | Fraction:
    """Evaluate an arithmetic expression of + - * / // and parentheses; raise SafeEvalError if invalid.
    exact=True: in Fractions (see the module docstring)."""
    if not isinstance(text, str):
        raise SafeEvalError(f"expected a string, got {type(text).__name__}")
    if len(text) > max_length:
        raise SafeEvalError(f"expression longer than {max_length} characters")
    tokens = _tokenize(text, max_digits, exact)
    if not tokens:
        raise SafeEvalError("empty expression")
    parser = _Parser(tokens, max_depth)
    value = parser.expr()
    if parser.pos != len(tokens):
        raise SafeEvalError(f"unexpected token {tokens[parser.pos][0]!r} at token {parser.pos}")
    return value


def try_safe_eval(text: str, **bounds) -> int | float | Fraction | None:
    """`safe_eval`, returning None instead of raising."""
    try:
        return safe_eval(text, **bounds)
    except SafeEvalError:
        return None
