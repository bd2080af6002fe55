"""The Qwen2.5 / Hermes tool-call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`parse_tool_calls(text)` returns one entry per `<tool_call>` block, in order: a `ToolCall` or, for a
block that is not a valid call (malformed or oversized JSON, a missing name, arguments that are not
an object, a block left open), a `ToolCallError` whose message becomes the model's observation.
The JSON is read with `json.loads` only (never eval); blocks and their nesting are bounded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 8192
"""Longest tool-call body parsed at all."""


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call."""

    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A `<tool_call>` block that could not be read as a call; `message` says why."""

    message: str


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _parse_body(body: str) -> ToolCall | ToolCallError:
    body = body.strip()
    if len(body) > MAX_CALL_CHARS:
        return ToolCallError(f"tool call longer than {MAX_CALL_CHARS} characters")
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        return ToolCallError(f"tool call is not valid JSON ({str(e)[:120]})")
    if not isinstance(obj, dict):
        return ToolCallError(f"tool call must be a JSON object with name and arguments, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError('tool call lacks a "name" string')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments object as a JSON string
        try:
            args = json.loads(args, parse_constant=_reject_constant) if args.strip() else {}
        except (ValueError, RecursionError):
            return ToolCallError(f'tool call {name!r}: "arguments" is a string that is not a JSON object')
    if not isinstance(args, dict):
        return ToolCallError(f'tool call {name!r}: "arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(name, args)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every `<tool_call>` block of an assistant turn, parsed (see the module docstring)."""
    calls: list[ToolCall | ToolCallError] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            return calls
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            calls.append(ToolCallError(f"{OPEN} without a closing {CLOSE}"))
            return calls
        calls.append(_parse_body(text[start + len(OPEN):end]))
        pos = end + len(CLOSE)
