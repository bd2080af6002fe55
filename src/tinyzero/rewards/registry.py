"""data_source -> scorer registry, TinyZero's lookup rules, and user-supplied reward functions.

Lookup (`get_scorer`): the exact data_source name first, then TinyZero's substring rules in
its order ("multiply" or "arithmetic" -> arithmetic, "countdown" -> countdown). An unknown
data_source raises `ValueError`; `check_data_sources` runs that check over a whole dataset
at start-up so a bad name fails before the first rollout, not mid-run.

A scorer is `fn(solution_str, ground_truth, extra_info, **options) -> float | dict`; a dict
carries "score" and optionally "acc" (bool) and "formatted" (bool). Register one with
`@register_scorer("my_source")`. A user function from `--reward.custom_fn file.py:name`
has veRL's signature `name(data_source, solution_str, ground_truth, extra_info)` and scores
every data_source.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from tinyzero.rewards import arithmetic, countdown, gsm8k, math_boxed

__all__ = [
    "SCORERS",
    "SUBSTRING_RULES",
    "register_scorer",
    "get_scorer",
    "check_data_sources",
    "default_compute_score",
    "load_custom_fn",
    "normalize_result",
]

SCORERS: dict[str, Callable[..., Any]] = {}
"""Exact data_source name -> scorer."""

SUBSTRING_RULES: list[tuple[tuple[str, ...], str]] = [
    (("multiply", "arithmetic"), "arithmetic"),
    (("countdown",), "countdown"),
]
"""TinyZero's fallbacks: if any substring occurs in data_source, use the named scorer."""


def register_scorer(*names: str):
    """Decorator: register a scorer under one or more exact data_source names."""

    def deco(fn):
        for name in names:
            SCORERS[name] = fn
        return fn

    return deco


@register_scorer("countdown")
def _countdown(solution_str, ground_truth, extra_info=None, countdown_last_line_only=True, **_):
    return countdown.score_details(solution_str, ground_truth, last_line_only=countdown_last_line_only)


@register_scorer("openai/gsm8k", "gsm8k")
def _gsm8k(solution_str, ground_truth, extra_info=None, gsm8k_method="strict", **_):
    return gsm8k.score_details(solution_str, ground_truth, method=gsm8k_method)


@register_scorer("arithmetic", "multiply")
def _arithmetic(solution_str, ground_truth, extra_info=None, **_):
    answer_format = "tagged"
    if isinstance(extra_info, dict) and extra_info.get("answer_format"):
        answer_format = extra_info["answer_format"]
    return arithmetic.score_details(solution_str, ground_truth, answer_format=answer_format)


@register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "math")
def _math(solution_str, ground_truth, extra_info=None, **_):
    return math_boxed.score_details(solution_str, ground_truth)


@register_scorer("codecontests", "apps", "codeforces", "taco", "code_exec")
def _code_exec(solution_str, ground_truth, extra_info=None, sandbox=None, **_):
    from tinyzero.rewards import code_exec  # the sandbox is imported only where code is scored

    return code_exec.compute_score(solution_str, ground_truth, sandbox=sandbox)


def get_scorer(data_source: str) -> Callable[..., Any]:
    """The scorer for data_source (exact name, then substring rules); ValueError if none."""
    fn = SCORERS.get(data_source)
    if fn is not None:
        return fn
    for needles, name in SUBSTRING_RULES:
        if any(n in data_source for n in needles):
            return SCORERS[name]
    raise ValueError(
        f"no reward function for data_source {data_source!r}; known names: {sorted(SCORERS)} "
        f"(or any name containing {[n for needles, _ in SUBSTRING_RULES for n in needles]}). "
        "Fix the data_source column or pass --reward.custom_fn path/to/file.py:function"
    )


def check_data_sources(data_sources: Iterable[str], custom_fn: str | None = None) -> None:
    """Fail at start-up when any data_source has no scorer (a custom_fn scores everything)."""
    if custom_fn:
        return
    unknown = sorted({str(d) for d in data_sources if _lookup_or_none(str(d)) is None})
    if unknown:
        raise ValueError(
            f"no reward function for data_source(s) {unknown}; known names: {sorted(SCORERS)} "
            f"(or any name containing {[n for needles, _ in SUBSTRING_RULES for n in needles]}). "
            "Fix the data_source column or pass --reward.custom_fn path/to/file.py:function"
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


def normalize_result(result) -> dict:
    """A scorer's number / bool / dict result as {"score": float, "acc": bool, "formatted": bool}.

    For a bare number, acc is score >= 1.0 and formatted is score > 0. None, a string, a dict
    without "score", or a NaN / infinite score raise (TypeError / ValueError).
    """
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"the scorer returned a dict without a 'score' key: {sorted(result)}")
        score = _finite_score(result["score"], "the scorer's result['score']")
        return {
            "score": score,
            "acc": bool(result.get("acc", score >= 1.0)),
            "formatted": bool(result.get("formatted", score > 0)),
        }
    score = _finite_score(result, "the scorer's result")
    return {"score": score, "acc": score >= 1.0, "formatted": score > 0}


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """The built-in score of one response (the public entry point of the registry)."""
    result = get_scorer(data_source)(solution_str, ground_truth, extra_info)
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
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{what}: {path!r} has no function named {name!r}")
    _CUSTOM_CACHE[spec] = fn
    return fn
