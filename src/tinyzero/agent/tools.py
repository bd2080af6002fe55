"""Tools a model calls during a multi-turn rollout: the `Tool` protocol, the registry, the calculator.

A tool is an object with a `name`, a `description`, `parameters` (the JSON schema of its
arguments, rendered into the prompt through the chat template's tools support, see
`render_tool_prompt`), a `timeout_s`, and `call(args: dict) -> str`. Register a class or factory
with `@register_tool("name")`, or name it on the command line as `path/to/file.py:Name`:

    class WordCount:
        name = "word_count"
        description = "Count the words of a text."
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        timeout_s = 2.0

        def call(self, args: dict) -> str:
            return str(len(args["text"].split()))

    --actor_rollout_ref.rollout.multi_turn.tools my_tools.py:WordCount

Calls run in tool worker processes (pool.py), never in the trainer's; a call that raises, hangs or
returns something huge becomes a "tool error: ..." or truncated observation.
"""

from __future__ import annotations

import json
from typing import Callable, Protocol, runtime_checkable

from tinyzero.rewards.registry import load_custom_fn
from tinyzero.rewards.safe_eval import SafeEvalError, safe_eval


@runtime_checkable
class Tool(Protocol):
    """What the agent loop needs of a tool (see the module docstring)."""

    name: str
    description: str
    parameters: dict
    timeout_s: float

    def call(self, args: dict) -> str:
        """The tool's answer to one call, as text (raise to report an error)."""
        ...


TOOLS: dict[str, Callable[[], Tool]] = {}
"""Registered tool name -> class or factory (called with no arguments)."""


def registrar(table: dict, kind: str):
    """A decorator factory registering classes or factories in `table` by name (`kind` names errors)."""
    def register(name: str):
        def wrap(factory):
            if name in table:
                raise ValueError(f"{kind} {name!r} is already registered")
            table[name] = factory
            return factory
        return wrap
    return register


def lookup(table: dict, spec: str, field_name: str):
    """The factory registered as `spec`, or loaded from `path/to/file.py:Name`; errors name `field_name`."""
    if spec in table:
        return table[spec]
    if ":" in spec:
        return load_custom_fn(spec, what=field_name)
    raise ValueError(f"{field_name}: unknown name {spec!r}; registered: {sorted(table)}, "
                     "or give path/to/file.py:ClassName")


register_tool = registrar(TOOLS, "tool")
"""Decorator registering a tool class or factory under a name (what multi_turn.tools lists)."""


def load_tool(spec: str) -> Tool:
    """A registered tool name, or `path/to/file.py:Name` (a class or factory), instantiated and checked."""
    tool = lookup(TOOLS, spec, "rollout.multi_turn.tools")()
    missing = [a for a in ("name", "description", "parameters", "call") if not hasattr(tool, a)]
    if missing:
        raise ValueError(f"rollout.multi_turn.tools: {spec!r} lacks {missing}; a tool needs name, description, "
                         "parameters (a JSON schema dict) and call(args) -> str")
    if not isinstance(tool.parameters, dict):
        raise ValueError(f"rollout.multi_turn.tools: {spec!r}.parameters must be a JSON-schema dict")
    return tool


def tool_timeout(tool: Tool, cap_s: float) -> float:
    """The tool's own timeout_s when it has a smaller one, else the configured cap."""
    own = getattr(tool, "timeout_s", None)
    return min(float(own), cap_s) if own and own > 0 else cap_s


def tool_schema(tool: Tool) -> dict:
    """The OpenAI / HF function schema chat templates render (`apply_chat_template(tools=...)`)."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


HERMES_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
HERMES_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>")


def hermes_tools_text(tools: list[Tool]) -> str:
    """The tool description Qwen2.5's template writes into the system turn (for templates without tools)."""
    return HERMES_TOOLS_HEADER + "".join("\n" + json.dumps(tool_schema(t)) for t in tools) + HERMES_TOOLS_FOOTER


def render_tool_prompt(messages: list[dict], tokenizer, tools: list[Tool]) -> str:
    """The prompt text of a tool-using task, for data preparation: the chat template rendered with
    `tools=` (its own tools support) and a generation prompt. A template that ignores `tools` (the
    rendering does not change) gets the Hermes tool description as (the end of) the system message.
    Store it as the row's single message with data.apply_chat_template=False."""
    schemas = [tool_schema(t) for t in tools]
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with_tools = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=False)
    if with_tools != plain:
        return with_tools
    text = hermes_tools_text(tools)
    if messages and messages[0]["role"] == "system":
        messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    else:
        messages = [{"role": "system", "content": text}, *messages]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@register_tool("calculator")
class Calculator:
    """Arithmetic (+ - * / // and parentheses) on the project's bounded evaluator (never eval)."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // and parentheses, e.g. 37 * 412."
    parameters = {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": "the expression"}},
                  "required": ["expression"]}
    timeout_s = 2.0

    def call(self, args: dict) -> str:
        expression = args.get("expression")
        if not isinstance(expression, str):
            raise ValueError('calculator needs {"expression": "<arithmetic>"}')
        try:
            value = safe_eval(expression)
        except SafeEvalError as e:
            raise ValueError(f"cannot evaluate {expression[:80]!r}: {e}") from None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value)
