"""Rule-based scorers: countdown against TinyZero's rules, gsm8k, arithmetic, MATH, the registry.

The countdown reference below restates TinyZero's published algorithm (regex extraction of the
last <answer> on the last line, `\\d+` number check, `eval` of strings matching
`^[\\d+\\-*/().\\s]+$`) and is run on test-generated responses only; the library scorer must
give the same score on every response that does not use `**` (rejected by design).
"""

from __future__ import annotations

import random
import re
import time
import warnings

import pytest

from tinyzero.rewards import arithmetic, countdown, gsm8k, math_boxed
from tinyzero.rewards.registry import check_data_sources, default_compute_score, get_scorer, load_custom_fn


def _tinyzero_countdown_reference(response: str, target, numbers, format_score=0.1, score=1.0):
    line = response.split("\n")[-1]
    matches = list(re.finditer(r"<answer>(.*?)</answer>", line))
    if not matches:
        return 0
    equation = matches[-1].group(1).strip()
    try:
        used = sorted(int(n) for n in re.findall(r"\d+", equation))
    except ValueError:
        return format_score
    if used != sorted(numbers):
        return format_score
    if not re.match(r"^[\d+\-*/().\s]+$", equation):
        return format_score
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            value = eval(equation, {"__builtins__": None}, {})  # test-generated input only
            return score if abs(value - target) < 1e-5 else format_score
        except Exception:
            return format_score


def _random_response(rng: random.Random, numbers: list[int]) -> str:
    parts = [str(n) for n in numbers]
    rng.shuffle(parts)
    if rng.random() < 0.3:
        parts = parts[:-1] if rng.random() < 0.5 else parts + [str(rng.randint(1, 99))]
    ops = "+-*/"
    expr = parts[0]
    for p in parts[1:]:
        op = rng.choice(ops + ("//" if rng.random() < 0.05 else ""))
        if rng.random() < 0.3:
            expr = f"({expr})"
        expr = f"{expr} {op} {p}"
    if rng.random() < 0.1:
        expr = expr.replace(" ", "", 1) + rng.choice(["x", ")", "(", " =", "%"])
    answer = f"<answer> {expr} </answer>"
    kind = rng.randint(0, 6)
    if kind == 0:
        return f"I think\n{answer}"
    if kind == 1:
        return f"{answer}\nand then nothing"
    if kind == 2:
        return f"<think>try</think> <answer>1 + 1</answer> then {answer}"
    if kind == 3:
        return f"no tags here {expr}"
    if kind == 4:
        return f"<answer>{expr}"
    if kind == 5:
        return f"{answer}</answer><answer></answer>"
    return answer


def test_countdown_matches_tinyzero_rules_on_random_responses():
    rng = random.Random(1)
    seen = {0: 0, 0.1: 0, 1.0: 0}
    for _ in range(3000):
        numbers = [rng.randint(1, 20) for _ in range(rng.randint(3, 4))]
        response = _random_response(rng, numbers)
        # Targets that some responses hit: evaluate a correct-looking expression half the time.
        expr = " + ".join(str(n) for n in numbers)
        target = sum(numbers) if rng.random() < 0.5 else rng.randint(1, 100)
        if rng.random() < 0.2:
            response = f"ok\n<answer>{expr}</answer>"
        expected = _tinyzero_countdown_reference(response, target, numbers)
        got = countdown.compute_score(response, {"target": target, "numbers": numbers})
        assert got == pytest.approx(expected), (response, target, numbers)
        seen[expected] = seen.get(expected, 0) + 1
    assert all(v > 50 for v in seen.values()), seen


@pytest.mark.parametrize("response,expected", [
    ("<answer>(3 + 5) * 8</answer>", 1.0),
    ("reasoning\n<answer> 8 * (5 + 3) </answer>", 1.0),
    ("<answer>(3 + 5) * 8</answer>\n", 0.0),  # the last line is empty (TinyZero's rule)
    ("<answer>3 + 5 + 8</answer>", 0.1),  # wrong value
    ("<answer>(3 + 5) * 8 * 1</answer>", 0.1),  # extra number
    ("<answer>(3 + 5) * 7</answer>", 0.1),  # wrong number
    ("<answer>8 ** 2 + 3 - 5 + 0 * 0</answer>", 0.1),  # exponentiation is never evaluated
    ("<answer>(3 + 5) / (8 - 8) </answer>", 0.1),
    ("<answer>8 / 0 + 3 + 5</answer>", 0.1),
    ("The answer is 64", 0.0),
    ("<answer>(\u0663 + 5) * 8</answer>", 0.1),  # a unicode digit counts as 3 but never evaluates
    ("<answer>(3 + 5) * 8 = 64</answer>", 0.1),  # "64" is an extra number
    ("<answer>(3+5)*8</answer> <answer>3*5*8</answer>", 0.1),  # the last tag counts
    ("<answer>3*5*8</answer> <answer>(3+5)*8</answer>", 1.0),
])
def test_countdown_cases(response, expected):
    assert countdown.compute_score(response, {"target": 64, "numbers": [3, 5, 8]}) == pytest.approx(expected)


def test_countdown_whole_response_option():
    gt = {"target": 64, "numbers": [3, 5, 8]}
    text = "<answer>(3 + 5) * 8</answer>\nthat is all"
    assert countdown.compute_score(text, gt) == 0.0
    assert countdown.compute_score(text, gt, last_line_only=False) == 1.0


@pytest.mark.parametrize("body", [
    "<answer>" * 1_250_000,
    "<answer>" + "1+" * 5_000_000 + "1</answer>",
    "<answer>" + "9" * 10_000_000 + "</answer>",
    "<answer>" + "(" * 5_000_000 + "3+5)*8</answer>",
    "<answer>" + "\u0663" * 5_000_000 + "</answer>",
    ("x" * 1000 + "\n") * 10_000 + "<answer>(3 + 5) * 8</answer>",
])
def test_adversarial_responses_score_in_bounded_time(body):
    gt = {"target": 64, "numbers": [3, 5, 8]}
    start = time.perf_counter()
    for fn in (lambda t: countdown.compute_score(t, gt), lambda t: countdown.compute_score(t, gt, last_line_only=False),
               lambda t: gsm8k.compute_score(t, "64", method="flexible"), lambda t: gsm8k.compute_score(t, "64"),
               lambda t: arithmetic.compute_score(t, "64"), lambda t: math_boxed.compute_score(t, "64")):
        assert 0.0 <= fn(body) <= 1.0
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("response,truth,method,expected", [
    ("so 2 + 3 = 5\n#### 5", "5", "strict", 1.0),
    ("#### 1,000", "1000", "strict", 1.0),
    ("#### $42", "42", "strict", 0.0),  # veRL / TinyZero: "$" breaks the strict format
    ("#### 42", "$42", "strict", 0.0),  # veRL compares with the ground truth as given
    ("#### 4 then #### 5", "5", "strict", 1.0),
    ("the answer is 5", "5", "strict", 0.0),
    ("#### 6", "5", "strict", 0.0),
    ("the answer is 5.", "5", "flexible", 0.0),  # veRL's flexible keeps the run as it stands: "5."
    ("the answer is 1,234 apples", "1,234", "flexible", 1.0),
    ("first 5 then 7", "5", "flexible", 0.0),
    ("no numbers", "5", "flexible", 0.0),
    ("#### -3", "-3", "strict", 1.0),
])
def test_gsm8k(response, truth, method, expected):
    assert gsm8k.compute_score(response, truth, method=method) == expected


def test_gsm8k_format_score_and_details():
    assert gsm8k.compute_score("#### 6", "5", format_score=0.1) == 0.1
    assert gsm8k.score_details("#### 6", "5") == {"score": 0.0, "acc": False, "formatted": True}
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("#### 5", "5", method="loose")


@pytest.mark.parametrize("response,truth,fmt,expected", [
    ("<think>x</think> <answer> 360801 </answer>", 360801, "tagged", 1.0),
    ("<answer>12</answer>", "13", "tagged", 0.1),
    ("<answer>twelve</answer>", "12", "tagged", 0.0),
    ("12", "12", "tagged", 0.0),
    ("19", "19", "plain", 1.0),
    (" 19\nmore", "19", "plain", 1.0),
    ("18", "19", "plain", 0.1),
    ("19abc", "19", "plain", 0.0),
    ("", "19", "plain", 0.0),
    ("-4", "-4", "plain", 1.0),
])
def test_arithmetic(response, truth, fmt, expected):
    assert arithmetic.compute_score(response, truth, answer_format=fmt) == expected


@pytest.mark.parametrize("response,truth,expected", [
    ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{ x = 5 }", "5", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{3} then \\boxed{4}", "4", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("no box 4", "4", 0.0),
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # unbalanced
    ("\\fbox{7}", "7", 1.0),
    ("\\boxed 7$", "7", 1.0),
])
def test_math_boxed(response, truth, expected):
    assert math_boxed.compute_score(response, truth) == expected


def test_registry_lookup_rules():
    assert get_scorer("countdown") is get_scorer("my_countdown_v2")  # substring rule
    assert get_scorer("yolo/multiply-3_digit") is get_scorer("arithmetic")
    assert get_scorer("openai/gsm8k") is get_scorer("gsm8k")
    assert get_scorer("lighteval/MATH") is get_scorer("HuggingFaceH4/MATH-500")
    assert get_scorer("math") is get_scorer("aime2024")  # veRL: math and aime* use the DAPO scorer
    with pytest.raises(ValueError, match="no reward function"):
        get_scorer("openai/humaneval")
    with pytest.raises(ValueError, match="custom_fn"):
        check_data_sources(["countdown", "unknown_src", "openai/gsm8k"])
    check_data_sources(["countdown", "openai/gsm8k", "arithmetic"])
    check_data_sources(["anything"], custom_fn="x.py:f")
    assert default_compute_score("arithmetic", "7", "7", {"answer_format": "plain"}) == 1.0
    assert default_compute_score("countdown", "<answer>1+2</answer>", {"target": 3, "numbers": [1, 2]}) == 1.0


def test_custom_fn_loading(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return {'score': float(solution_str == ground_truth), 'acc': solution_str == ground_truth}\n")
    fn = load_custom_fn(f"{path}:score")
    assert fn("x", "a", "a") == {"score": 1.0, "acc": True}
    with pytest.raises(ValueError, match="no function named"):
        load_custom_fn(f"{path}:missing")
    with pytest.raises(ValueError, match="does not exist"):
        load_custom_fn(f"{tmp_path}/nope.py:score")
    with pytest.raises(ValueError, match="path/to/file.py:function_name"):
        load_custom_fn("no_colon")
