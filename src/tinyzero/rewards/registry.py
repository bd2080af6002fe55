"""data_source -> scorer registry, veRL's and TinyZero's lookup rules, and user-supplied reward functions.

Lookup (`get_scorer`): the exact data_source name first, then veRL's prefix rule ("aime..." -> the
DAPO math scorer), then TinyZero's substring rules in its order ("multiply" or "arithmetic" ->
arithmetic, "countdown" -> countdown). An unknown data_source raises `ValueError`;
`check_data_sources` runs that check over a whole dataset at start-up so a bad name fails before the
first rollout, not mid-run.

veRL's sources score as veRL's `default_compute_score` does:

    openai/gsm8k                                   gsm8k       1 / 0 (strict "#### n")
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500
                                                   math_reward 1 / 0 (hendrycks is_equiv)
    math, math_dapo, math_dapo_reasoning, aime*    math_dapo   {"score": +1 / -1, "acc", "pred"}
    numina_aops_forum, numina_synthetic_math, numina_amc_aime, numina_synthetic_amc, numina_cn_k12,
    numina_olympiads                               prime_math  1 / 0
    hiyouga/geometry3k                             geo3k       0.9 x acc + 0.1 x format
    searchR1_nq, _triviaqa, _popqa, _hotpotqa, _2wikimultihopqa, _musique, _bamboogle
                                                   search_r1   1 / 0.25 / 0 (exact match)

tinyzero's and TinyZero's own: countdown, arithmetic / multiply, gsm8k (= openai/gsm8k), and
math_boxed (the lenient \\boxed scorer, 1 / 0).

A scorer is `fn(solution_str, ground_truth, extra_info, **options) -> float | dict`; a dict carries
"score" and any other keys, all of which travel as reward_extra_info. Register one with
`@register_scorer("my_source")`; `details=True` marks a dict that is tinyzero's detail record
({"score", "acc", "formatted"}) of a scorer whose public result is the bare score: its acc and
formatted feed tinyzero's reward/<source>/acc and format_rate metrics but are no reward_extra_info,
and `default_compute_score` returns only the score. A user
function (`custom_reward_function.path` / `.name`, or the older `reward.custom_fn file.py:name`)
scores every data_source.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from tinyzero.rewards import (
    arithmetic,
    countdown,
    geo3k,
    gsm8k,
    math_boxed,
    math_dapo,
    math_reward,
    prime_math,
    search_r1,
)

__all__ = [
    "SCORERS",
    "DETAIL_SCORERS",
    "PREFIX_RULES",
    "SUBSTRING_RULES",
    "register_scorer",
    "get_scorer",
    "check_data_sources",
    "default_compute_score",
    "load_custom_fn",
    "normalize_result",
    "plain_value",
]

SCORERS: dict[str, Callable[..., Any]] = {}
"""Exact data_source name -> scorer."""

DETAIL_SCORERS: set[Callable[..., Any]] = set()
"""Scorers whose dict is tinyzero's detail record (default_compute_score returns its score)."""

PREFIX_RULES: list[tuple[str, str]] = [("aime", "math_dapo")]
"""veRL's prefix rule: a data_source starting with the prefix uses the named scorer."""

SUBSTRING_RULES: list[tuple[tuple[str, ...], str]] = [
    (("multiply", "arithmetic"), "arithmetic"),
    (("countdown",), "countdown"),
]
"""TinyZero's fallbacks: if any substring occurs in data_source, use the named scorer."""


def register_scorer(*names: str, details: bool = False):
    """Decorator: register a scorer under one or more exact data_source names."""

    def deco(fn):
        for name in names:
            SCORERS[name] = fn
        if details:
            DETAIL_SCORERS.add(fn)
        return fn

    return deco


@register_scorer("countdown", details=True)
def _countdown(solution_str, ground_truth, extra_info=None, countdown_last_line_only=True, **_):
    return countdown.score_details(solution_str, ground_truth, last_line_only=countdown_last_line_only)


@register_scorer("openai/gsm8k", "gsm8k", details=True)
def _gsm8k(solution_str, ground_truth, extra_info=None, gsm8k_method="strict", **_):
    return gsm8k.score_details(solution_str, ground_truth, method=gsm8k_method)


@register_scorer("arithmetic", "multiply", details=True)
def _arithmetic(solution_str, ground_truth, extra_info=None, **_):
    answer_format = "tagged"
    if isinstance(extra_info, dict) and extra_info.get("answer_format"):
        answer_format = extra_info["answer_format"]
    return arithmetic.score_details(solution_str, ground_truth, answer_format=answer_format)


@register_scorer("math_boxed", details=True)
def _math_boxed(solution_str, ground_truth, extra_info=None, **_):
    return math_boxed.score_details(solution_str, ground_truth)


@register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def _math_reward(solution_str, ground_truth, extra_info=None, **_):
    return math_reward.compute_score(solution_str, ground_truth)


@register_scorer("math", "math_dapo", "math_dapo_reasoning")
def _math_dapo(solution_str, ground_truth, extra_info=None, **_):
    return math_dapo.compute_score(solution_str, ground_truth)


@register_scorer("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                 "numina_cn_k12", "numina_olympiads")
def _prime_math(solution_str, ground_truth, extra_info=None, **_):
    return prime_math.compute_score(solution_str, ground_truth)


@register_scorer("hiyouga/geometry3k")
def _geo3k(solution_str, ground_truth, extra_info=None, **_):
    return geo3k.compute_score(solution_str, ground_truth)


@register_scorer("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                 "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")
def _search_r1(solution_str, ground_truth, extra_info=None, **_):
    return search_r1.compute_score(solution_str, ground_truth)


@register_scorer("codecontests", "apps", "codeforces", "taco", "code_exec")
def _code_exec(solution_str, ground_truth, extra_info=None, sandbox=None, **_):
    from tinyzero.rewards import code_exec  # the sandbox is imported only where code is scored

    return code_exec.compute_score(solution_str, ground_truth, sandbox=sandbox)


def get_scorer(data_source: str) -> Callable[..., Any]:
    """The scorer for data_source (exact name, then substring rules); ValueError if none."""
    fn = SCORERS.get(data_source)
    if fn is not None:
        return fn
    for prefix, name in PREFIX_RULES:
        if data_source.startswith(prefix):
            return SCORERS[name]
    for needles, name in SUBSTRING_RULES:
        if any(n in data_source for n in needles):
            return SCORERS[name]
    raise ValueError(
        f"no reward function for data_source {data_source!r}; known names: {sorted(SCORERS)} "
        f"(or any name starting with {[p for p, _ in PREFIX_RULES]} or containing "
        f"{[n for needles, _ in SUBSTRING_RULES for n in needles]}). "
        "Fix the data_source column or set custom_reward_function.path=path/to/file.py "
        "(or the older reward.custom_fn=path/to/file.py:function)"
    )


def check_data_sources(data_sources: Iterable[str], custom_fn: str | None = None) -> None:
    """Fail at start-up when any data_source has no scorer (a custom_fn scores everything)."""
    if custom_fn:
        return
    unknown = sorted({str(d) for d in data_sources if _lookup_or_none(str(d)) is None})
    if unknown:
        raise ValueError(
            f"no reward function for data_source(s) {unknown}; known names: {sorted(SCORERS)} "
            f"(or any name starting with {[p for p, _ in PREFIX_RULES]} or containing "
            f"{[n for needles, _ in SUBSTRING_RULES for n in needles]}). "
            "Fix the data_source column or set custom_reward_function.path=path/to/file.py "
        "(or the older reward.custom_fn=path/to/file.py:function)"
        )


def _lookup_or_none(data_source: str):
    try:
        return get_scorer(data_source)
    except ValueError:
        return None


def _finite_score(value, what: str) -> float:
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r:.100}")
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r:.100}") from None
    if not math.isfinite(score):
        raise ValueError(f"{what} is not finite: {score}")
    return score


def plain_value(value):
    """A scorer's reward_extra_info value as plain Python (bool / int / float / str / None, lists and dicts
    of them): numpy and torch scalars become Python scalars, arrays lists, anything else its str()."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_value(v) for k, v in value.items()}
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy / torch scalars and arrays
        try:
            return plain_value(value.tolist())
        except (TypeError, ValueError):
            pass
    return str(value)


def normalize_result(result) -> dict:
    """A scorer's number / bool / dict result as {"score": float, "acc": bool, "formatted": bool, "extra": dict}.

    "extra" holds every key of a dict result (score included) as plain values (`plain_value`): the
    sample's reward_extra_info; {} for a bare number. acc and formatted come from the dict where it has
    them; else acc is score >= 1.0 and formatted is score > 0. None, a string, a dict without "score",
    or a NaN / infinite score raise (TypeError / ValueError).
    """
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"the scorer returned a dict without a 'score' key: {sorted(map(str, result))}")
        score = _finite_score(result["score"], "the scorer's result['score']")
        return {
            "score": score,
            "acc": bool(result.get("acc", score >= 1.0)),
            "formatted": bool(result.get("formatted", score > 0)),
            "extra": {str(k): plain_value(v) for k, v in result.items()},
        }
    score = _finite_score(result, "the scorer's result")
    return {"score": score, "acc": score >= 1.0, "formatted": score > 0, "extra": {}}


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None, **kwargs):
    """The built-in score of one response, as veRL's default_compute_score returns it: a float, or the
    scorer's dict where veRL's scorer returns one (the DAPO math scorer). `kwargs` (veRL's sandbox
    settings and the like) are accepted and not used by these scorers."""
    del kwargs
    fn = get_scorer(data_source)
    result = fn(solution_str, ground_truth, extra_info)
    if isinstance(result, dict) and fn not in DETAIL_SCORERS:
        return result
    return normalize_result(result)["score"]


_CUSTOM_CACHE: dict[str, Callable[..., Any]] = {}


def load_custom_fn(spec: str, what: str = "reward.custom_fn") -> Callable[..., Any]:
    """Load `path/to/file.py:function` (the file is imported as a fresh module); errors name `what`."""
    if spec in _CUSTOM_CACHE:
        return _CUSTOM_CACHE[spec]
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"{what} must look like path/to/file.py:function_name, got {spec!r}")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ValueError(f"{what}: file {path!r} does not exist")
    module_name = f"tinyzero_custom_reward_{abs(hash(path))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{what}: cannot import {path!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(module_name, None)
        raise ValueError(f"{what}: {path}:{e.lineno}: {e.msg} (a syntax error); fix the file") from e
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ValueError(f"{what}: importing {path!r} failed with {type(e).__name__}: {e}; fix the file or "
                         "install what it imports") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{what}: {path!r} has no function named {name!r}")
    _CUSTOM_CACHE[spec] = fn
    return fn
