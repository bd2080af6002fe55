"""Agentic multi-turn rollout, token in / token out: an engine wrapper, tools and environments.

    rollout.multi_turn.enable=True  rollout.multi_turn.tools=[calculator]  rollout.name=native|vllm

`AgentRollout` (loop.py) wraps whichever engine rollout.name builds (`build_agent_engine` builds the
engine and wraps it when multi_turn.enable): it calls the inner engine on
the samples still active (samples in different turns batched together), parses tool calls
(parser.py), runs the tools in a sandboxed worker-process pool (pool.py, tool_worker.py), appends
the observation as the chat template's tokens (chat.py) and continues up to max_turns and the
response-token budget. The trainer sees exactly the sampled ids; observation tokens carry
response_mask 0. `Tool` (tools.py) and `Environment` (environment.py) are the extension points,
registered by name or loaded from `path/to/file.py:Name`.

Heavy modules (torch) are imported lazily so that tool worker processes stay light.
"""

from __future__ import annotations

__all__ = ["AgentRollout", "build_agent_engine", "ENVIRONMENTS", "Environment", "MultiTurnConfig", "TOOLS", "Tool", "load_environment",
           "load_tool", "parse_tool_calls", "register_environment", "register_tool"]

_LAZY = {
    "AgentRollout": "tinyzero.agent.loop", "build_agent_engine": "tinyzero.agent.loop",
    "MultiTurnConfig": "tinyzero.rollout.multi_turn",
    "ENVIRONMENTS": "tinyzero.agent.environment", "Environment": "tinyzero.agent.environment",
    "load_environment": "tinyzero.agent.environment", "register_environment": "tinyzero.agent.environment",
    "TOOLS": "tinyzero.agent.tools", "Tool": "tinyzero.agent.tools", "load_tool": "tinyzero.agent.tools",
    "register_tool": "tinyzero.agent.tools", "parse_tool_calls": "tinyzero.agent.parser",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tinyzero.agent' has no attribute {name!r}")
