"""Multi-turn (agentic) rollout configuration: `actor_rollout_ref.rollout.multi_turn`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MultiTurnConfig:
    """The agent loop around the rollout engine (tinyzero.agent): turns, tools, environment, sandbox."""

    enable: bool = False
    """True: every rollout is a multi-turn loop (generate, parse tool calls, run tools, append the
    observation tokens, continue) around the engine rollout.name picks; False: one assistant turn."""
    max_turns: int = 4
    """Most assistant turns per sample; a sample still calling tools after this many ends with
    stop_reason max_turns. The total response tokens (model + observation) stay within
    rollout.response_length."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call: registered names (built in: "calculator") or `path/to/file.py:Name`
    (a class or factory returning a Tool)."""
    environment: str = ""
    """An Environment instead of tool calls (games, checkers): a registered name or
    `path/to/file.py:Name`; empty: none. Its step() sees every assistant turn; tools are then unused."""
    num_tool_workers: int = 2
    """Tool worker processes per rank (tools never run in the trainer's process)."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call unless the tool sets a smaller `timeout_s`; a call past it
    is killed and becomes a "tool error: timed out" observation."""
    tool_memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) of each tool worker process, in MiB above what it uses at start."""
    max_observation_chars: int = 2000
    """A tool result or error longer than this many characters is truncated (with a marker)."""
    max_tool_calls_per_turn: int = 4
    """Tool calls run per assistant turn; more are answered with a tool error."""
    stop_at_tool_call: bool = True
    """True: with tools, a turn ends right after the model writes a tool call's closing tag
    (`</tool_call>`, kept in the response; the engine gets it as a stop sequence), the tool runs and the
    next turn sees its result, so one call per turn. False: turns end at a stop token only (the model
    may write several calls in one turn, and whatever it writes after them)."""
    stop_on_tool_error: bool = False
    """True: a sample ends at its first failed tool call (stop_reason tool_error) instead of seeing
    the error as its observation and going on."""

    def __post_init__(self):
        if isinstance(self.tools, str):
            self.tools = [t for t in self.tools.split(",") if t]
        if self.max_turns < 1:
            raise ValueError(f"rollout.multi_turn.max_turns={self.max_turns} must be >= 1")
        if self.num_tool_workers < 1:
            raise ValueError(f"rollout.multi_turn.num_tool_workers={self.num_tool_workers} must be >= 1")
        if self.tool_timeout_s <= 0:
            raise ValueError(f"rollout.multi_turn.tool_timeout_s={self.tool_timeout_s} must be > 0 (seconds)")
        if self.tool_memory_mb < 16:
            raise ValueError(f"rollout.multi_turn.tool_memory_mb={self.tool_memory_mb} must be >= 16 (MiB)")
        if self.max_observation_chars < 16:
            raise ValueError(f"rollout.multi_turn.max_observation_chars={self.max_observation_chars} must be >= 16")
        if self.max_tool_calls_per_turn < 1:
            raise ValueError(f"rollout.multi_turn.max_tool_calls_per_turn={self.max_tool_calls_per_turn} must be >= 1")
        if self.enable and not self.tools and not self.environment:
            raise ValueError("rollout.multi_turn.enable=True needs rollout.multi_turn.tools (e.g. [calculator]) "
                             "or rollout.multi_turn.environment")
        if self.tools and self.environment:
            raise ValueError("rollout.multi_turn: set tools or environment, not both (an environment's step() "
                             "handles every assistant turn)")
