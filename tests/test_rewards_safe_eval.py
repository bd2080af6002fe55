"""The bounded arithmetic evaluator against Python's own evaluation, plus its bounds.

Reference: Python `eval` of the same test-generated strings (restricted to the characters a
countdown answer may hold, `**` excluded because the evaluator rejects it by design). Both
must agree exactly: the same value (==, same type family) or both invalid.
"""

from __future__ import annotations

import random
import time
import warnings

import pytest

from tinyzero.rewards.safe_eval import MAX_DEPTH, SafeEvalError, safe_eval, try_safe_eval

_PIECES = ["0", "1", "2", "7", "12", "07", "00", "3.5", ".5", "4.", "+", "-", "*", "/", "//", "(", ")", " ",
           "(", ")", "9", "10"]


def _python_reference(text: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            value = eval(text, {"__builtins__": {}}, {})  # test-generated input only
        except Exception:
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def test_matches_python_on_random_expressions():
    rng = random.Random(0)
    checked = valid = 0
    for _ in range(6000):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 12)))
        if "**" in text:
            continue
        expected = _python_reference(text)
        got = try_safe_eval(text)
        checked += 1
        if expected is None:
            assert got is None, (text, got)
        else:
            valid += 1
            assert got is not None and got == expected and type(got) is type(expected), (text, got, expected)
    assert valid > 300  # the generator produces plenty of valid expressions, not only garbage
    assert checked > 5000


@pytest.mark.parametrize("text,expected", [
    ("(1 + 2) / 3", 1.0), ("3 * -2", -6), ("--3", 3), ("7 // 2", 3), ("-7 // 2", -4), ("8 / 4 / 2", 1.0),
    ("2 * (3 + 4) - 5", 9), ("1.5 + 1.", 2.5), (" 44 - 19 + 3 ", 28),
])
def test_known_values(text, expected):
    assert safe_eval(text) == expected


@pytest.mark.parametrize("text", [
    "2 ** 3", "2 *** 3", "1 / 0", "5 // 0", "1.0 / 0", "2(3)", "(2)(3)", "07", "1 +", "()", "", "   ",
    "__import__('os')", "1e5", "3 % 2", "\u0663 + 1", "1\u00a0+ 1", "1 ^ 2", "abs(-1)", "1..2", ".",
])
def test_rejected(text):
    with pytest.raises(SafeEvalError):
        safe_eval(text)


def test_bounds():
    assert safe_eval("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH) == 1
    with pytest.raises(SafeEvalError):
        safe_eval("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1))
    with pytest.raises(SafeEvalError):
        safe_eval("9" * 33)
    with pytest.raises(SafeEvalError):
        safe_eval("1+" * 600 + "1")  # longer than the length bound
    assert safe_eval("1+" * 400 + "1") == 401


@pytest.mark.parametrize("text", [
    "9" * 10_000_000, "(" * 10_000_000, "1+" * 5_000_000, "-" * 10_000_000 + "1", "\u0663" * 10_000_000,
])
def test_adversarial_inputs_are_cheap(text):
    start = time.perf_counter()
    assert try_safe_eval(text) is None
    assert time.perf_counter() - start < 1.0


def test_no_deep_recursion_within_length_bound():
    # 499 nested unary minus signs are parsed iteratively.
    assert safe_eval("-" * 499 + "1") == -1
