"""Judge templates and score parsers for LLM-as-judge rewards, registered by name like scorers.

A template turns one sample into the chat messages the judge reads; a parser turns the judge's reply
into a score in [0, 1] or raises `JudgeParseError`:

    @register_judge_template("strict")
    def strict(prompt: str, response: str, reference: str | None) -> list[dict]:
        return [{"role": "user", "content": f"...{prompt}...{response}... End with 'Score: N' (0-10)."}]

    @register_judge_parser("yes_no_strict")
    def yes_no_strict(text: str) -> float: ...

reward.judge.template / reward.judge.parser name a registered entry, or a user function as
`path/to/file.py:function` with the same signature. With reward.judge.mode=pairwise they are looked up
among the pairwise ones: a template `fn(prompt, response_a, response_b, reference) -> messages` and a
parser `fn(reply) -> preference for A in [0, 1]` (1: A is better, 0: B is, 0.5: a tie), registered with
`register_judge_template(name, pairwise=True)` / `register_judge_parser(name, pairwise=True)`.

Built in:
    templates  default   the prompt, the response and (when the row has one) the reference answer; asks
                         for a 0-10 rating ending in "Score: N"
               yes_no    asks whether the response answers the prompt correctly, "Yes" or "No"
    parsers    default   the last "Score: N" (N in 0..10, "N/10" accepted); N / 10. A reply without
                         such a line is a parse error, never a number picked from its text
               last_number  the last number in the reply, in 0..10; N / 10 (for judges that answer
                         with a bare number)
               yes_no    the first "yes" / "no" word: 1 / 0
    pairwise   default   template: the prompt, answers A and B, the reference when there is one; asks for
                         a verdict "[[A]]", "[[B]]" or "[[C]]" (a tie). parser: the last such verdict ->
                         1 / 0 / 0.5
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["JUDGE_PARSERS", "JUDGE_TEMPLATES", "JudgeParseError", "get_judge_parser", "get_judge_template",
           "register_judge_parser", "register_judge_template"]

JUDGE_TEMPLATES: dict[str, Callable[[str, str, str | None], list[dict]]] = {}
"""Template name -> fn(prompt, response, reference) -> chat messages."""

JUDGE_PARSERS: dict[str, Callable[[str], float]] = {}
"""Parser name -> fn(judge_reply) -> score in [0, 1] (JudgeParseError when the reply holds none)."""

PAIRWISE_TEMPLATES: dict[str, Callable[[str, str, str, str | None], list[dict]]] = {}
"""Pairwise template name -> fn(prompt, response_a, response_b, reference) -> chat messages."""

PAIRWISE_PARSERS: dict[str, Callable[[str], float]] = {}
"""Pairwise parser name -> fn(judge_reply) -> preference for A in [0, 1] (JudgeParseError when none)."""

MAX_SCORE = 10
"""The default template's scale: 0..MAX_SCORE, normalised to [0, 1]."""


class JudgeParseError(ValueError):
    """The judge's reply holds no score the parser accepts."""


def register_judge_template(name: str, pairwise: bool = False):
    """Decorator: register a judge template under `name` (pairwise: a template of two responses)."""

    def deco(fn):
        (PAIRWISE_TEMPLATES if pairwise else JUDGE_TEMPLATES)[name] = fn
        return fn

    return deco


def register_judge_parser(name: str, pairwise: bool = False):
    """Decorator: register a judge score parser under `name` (pairwise: a parser of a preference)."""

    def deco(fn):
        (PAIRWISE_PARSERS if pairwise else JUDGE_PARSERS)[name] = fn
        return fn

    return deco


def registered(setting: str, pairwise: bool) -> dict[str, Callable]:
    """The registry that reward.judge.<setting> ("template" or "parser") names an entry of."""
    if setting == "template":
        return PAIRWISE_TEMPLATES if pairwise else JUDGE_TEMPLATES
    return PAIRWISE_PARSERS if pairwise else JUDGE_PARSERS


def _lookup(name: str, table: dict, setting: str) -> Callable:
    if name in table:
        return table[name]
    if ":" in name and name.rpartition(":")[0].endswith(".py"):
        from tinyzero.rewards.registry import load_custom_fn

        return load_custom_fn(name, what=setting)
    raise ValueError(f"{setting}={name!r} is not a registered name; choose one of {sorted(table)} or give "
                     "path/to/file.py:function")


def get_judge_template(name: str, pairwise: bool = False) -> Callable[..., list[dict]]:
    """The template registered as `name` (or a `file.py:function`); ValueError naming the setting if none."""
    return _lookup(name, registered("template", pairwise), "reward.judge.template")


def get_judge_parser(name: str, pairwise: bool = False) -> Callable[[str], float]:
    """The parser registered as `name` (or a `file.py:function`); ValueError naming the setting if none."""
    return _lookup(name, registered("parser", pairwise), "reward.judge.parser")


# ---------------------------------------------------------------------------------------------- templates
_SYSTEM = "You are a careful, impartial grader of answers written by an AI assistant."


@register_judge_template("default")
def default_template(prompt: str, response: str, reference: str | None) -> list[dict]:
    parts = [f"[Question]\n{prompt.strip()}"]
    if reference:
        parts.append(f"[Reference answer]\n{reference.strip()}")
    parts.append(f"[Assistant's answer]\n{response.strip()}")
    ask = (f"Rate the assistant's answer to the question from 0 (wrong or useless) to {MAX_SCORE} (fully correct "
           "and helpful)")
    ask += ", using the reference answer as the truth." if reference else "."
    ask += " Explain briefly, then end with a line of the form 'Score: N'."
    parts.append(ask)
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]


@register_judge_template("yes_no")
def yes_no_template(prompt: str, response: str, reference: str | None) -> list[dict]:
    ref = f"Reference answer: {reference.strip()}\n" if reference else ""
    content = (f"Question: {prompt.strip()}\n{ref}Answer: {response.strip()}\n\n"
               "Is the answer correct? Reply with Yes or No only.")
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": content}]


# ---------------------------------------------------------------------------------------------- parsers
_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_SCORE_LINE = re.compile(r"score\W{0,4}?\s*[:=]\s*\**\s*(" + _NUMBER + r")(\s*/\s*(" + _NUMBER + r"))?",
                         re.IGNORECASE)
_ANY_NUMBER = re.compile(r"(?<![\w.])(" + _NUMBER + r")(?![\w])")


def _in_range(value: float, text: str) -> float:
    if not 0 <= value <= MAX_SCORE:
        raise JudgeParseError(f"the judge's score {value:g} is outside 0..{MAX_SCORE} in {text[-200:]!r}")
    return value / MAX_SCORE


def _last_number(text: str) -> float:
    numbers = _ANY_NUMBER.findall(text)
    if not numbers:
        raise JudgeParseError(f"no number in the judge's reply {text[-200:]!r}")
    return _in_range(float(numbers[-1]), text)


@register_judge_parser("default")
def default_parser(text: str) -> float:
    matches = list(_SCORE_LINE.finditer(text))
    if not matches:
        raise JudgeParseError(f"no 'Score: N' line in the judge's reply {text[-200:]!r}")
    m = matches[-1]
    value = float(m.group(1))
    if m.group(3) is not None and float(m.group(3)) != MAX_SCORE:
        raise JudgeParseError(f"the judge scored {m.group(0)!r}, not out of {MAX_SCORE}, in {text[-200:]!r}")
    return _in_range(value, text)


@register_judge_parser("last_number")
def last_number_parser(text: str) -> float:
    return _last_number(text)


_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


@register_judge_parser("yes_no")
def yes_no_parser(text: str) -> float:
    m = _YES_NO.search(text)
    if m is None:
        raise JudgeParseError(f"neither 'yes' nor 'no' in the judge's reply {text[-200:]!r}")
    return 1.0 if m.group(1).lower() == "yes" else 0.0


# ---------------------------------------------------------------------------------------------- pairwise
@register_judge_template("default", pairwise=True)
def pairwise_template(prompt: str, response_a: str, response_b: str, reference: str | None) -> list[dict]:
    parts = [f"[Question]\n{prompt.strip()}"]
    if reference:
        parts.append(f"[Reference answer]\n{reference.strip()}")
    parts.append(f"[Answer A]\n{response_a.strip()}")
    parts.append(f"[Answer B]\n{response_b.strip()}")
    ask = "Which answer is better: more correct, then more helpful"
    ask += ", using the reference answer as the truth?" if reference else "?"
    ask += (" Do not let the order or the length of the answers sway you. Explain briefly, then end with your "
            "verdict: [[A]] if A is better, [[B]] if B is better, [[C]] for a tie.")
    parts.append(ask)
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]


_VERDICT = re.compile(r"\[\[\s*([ABC])\s*\]\]", re.IGNORECASE)


@register_judge_parser("default", pairwise=True)
def pairwise_parser(text: str) -> float:
    verdicts = _VERDICT.findall(text)
    if not verdicts:
        raise JudgeParseError(f"no verdict [[A]], [[B]] or [[C]] in the judge's reply {text[-200:]!r}")
    return {"A": 1.0, "B": 0.0, "C": 0.5}[verdicts[-1].upper()]
