"""Environments: multi-turn tasks that are not tool calls (games, checkers, simulated users).

An environment object serves one sample. The loop calls `reset(row)` once, where row holds the
sample's prompt (`prompt_ids`, `prompt_text`) and the prompt batch's non-tensor fields for it; a
non-empty list of chat messages returned by reset replaces the prompt (rendered with the chat
template and a generation prompt), an empty list keeps the dataset's prompt. After every assistant
turn the loop calls `step(assistant_text)` -> (observation, reward, done): the observation (a user
turn; None or "" for none) is appended as tokens unless done, and the rewards are summed into the
sample's non-tensor `env_reward`. Register a class with `@register_environment("name")` or name it
as `path/to/file.py:Name` in rollout.multi_turn.environment:

    class GuessNumber:
        def reset(self, row):
            self.target = 7
            return [{"role": "user", "content": "Guess my number (1-10). Answer with a number."}]

        def step(self, assistant_text):
            guess = assistant_text.strip()
            if guess == str(self.target):
                return None, 1.0, True
            return "higher" if guess.isdigit() and int(guess) < self.target else "lower", 0.0, False

Environments run in the rollout process (they are the task's own code, like reward functions).
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from tinyzero.agent.tools import lookup, registrar


@runtime_checkable
class Environment(Protocol):
    """One sample's environment (see the module docstring)."""

    def reset(self, row: dict) -> list[dict]:
        """The conversation to start from (empty: the dataset's prompt)."""
        ...

    def step(self, assistant_text: str) -> tuple[str | None, float, bool]:
        """(observation, reward, done) after one assistant turn."""
        ...


ENVIRONMENTS: dict[str, Callable[[], Environment]] = {}
"""Registered environment name -> class or factory (called with no arguments, once per sample)."""


register_environment = registrar(ENVIRONMENTS, "environment")
"""Decorator registering an environment class or factory under a name."""


def load_environment(spec: str) -> Callable[[], Environment]:
    """The factory of a registered environment name or of `path/to/file.py:Name`."""
    factory = lookup(ENVIRONMENTS, spec, "rollout.multi_turn.environment")
    probe = factory()
    if not (callable(getattr(probe, "reset", None)) and callable(getattr(probe, "step", None))):
        raise ValueError(f"rollout.multi_turn.environment: {spec!r} must build an object with reset(row) -> "
                         "messages and step(assistant_text) -> (observation, reward, done)")
    return factory
