"""How rule-based rewards are computed: RewardConfig (the `reward` section of the root config) and
CustomRewardFunctionConfig (veRL's top-level `custom_reward_function` section).

veRL's names for a user reward function and the reward manager:

    custom_reward_function.path=my_reward.py custom_reward_function.name=compute_score
    +custom_reward_function.reward_kwargs.weight=0.5      # extra keyword arguments of every call
    reward_model.reward_manager=batch                     # naive | batch | dapo | prime
    +reward_model.reward_kwargs.threshold=3               # keyword arguments of the reward manager

The older `reward.custom_fn=path/to/file.py:name` keeps working (positional call, no reward_kwargs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tinyzero.rewards.judge_config import JudgeConfig
from tinyzero.rewards.sandbox_config import SandboxConfig

__all__ = ["CustomRewardFunctionConfig", "OverlongBufferConfig", "RewardConfig", "RewardManagerName",
           "REWARD_MANAGERS"]

RewardManagerName = Literal["naive", "batch", "dapo", "prime"]
"""veRL's reward managers (reward_model.reward_manager); see tinyzero.rewards.manager for what each changes."""
REWARD_MANAGERS = ("naive", "batch", "dapo", "prime")

_GSM8K_METHODS = ("strict", "flexible")
_ON_ERROR = ("raise", "zero")


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (`reward.overlong_buffer`; veRL: reward_model.overlong_buffer)."""

    enable: bool = False
    """Add a linear length penalty to the score of responses longer than
    data.max_response_length - len tokens (see tinyzero.rewards.overlong)."""
    len: int = 4096
    """The buffer: the last `len` tokens before data.max_response_length, over which the penalty
    grows from 0 to penalty_factor (must be >= 1 and <= data.max_response_length)."""
    penalty_factor: float = 1.0
    """The penalty at a response of data.max_response_length tokens (>= 0)."""

    def __post_init__(self):
        if self.len < 1:
            raise ValueError(f"reward.overlong_buffer.len must be >= 1 token, got {self.len}")
        if self.penalty_factor < 0:
            raise ValueError(f"reward.overlong_buffer.penalty_factor must be >= 0, got {self.penalty_factor}")


@dataclass
class RewardConfig:
    custom_fn: str | None = None
    """A user reward function `path/to/file.py:function_name` with signature
    `(data_source, solution_str, ground_truth, extra_info) -> float | dict`; it replaces the
    built-in scorers for every data_source. None uses the built-in registry."""

    num_workers: int = 2
    """Scoring processes per rank. A custom_fn always runs in them (at least 1), where a stuck
    function can be killed; built-in scorers use them only for batches of parallel_min_batch or
    more (0: built-in scorers always in-process)."""

    parallel_min_batch: int = 2048
    """Built-in scorers: batches (per rank) with fewer samples than this are scored in-process. They
    are trusted code, bounded by the per-sample alarm, and in-process is faster for small batches."""

    timeout_s: float = 10.0
    """Per-sample time limit; a scorer that runs longer scores 0 and is counted in reward/num_timeouts
    (the first one is printed, naming the function and the sample). 0 disables the limit. A custom_fn
    that ignores the alarm is killed timeout_s + 2 s after its sample started."""

    batch_timeout_s: float = 600.0
    """Per-batch time budget of a custom_fn (every rank's share of the batch). Past it the scoring
    gives up: with on_error="raise" the run stops naming the function, the samples in flight and the
    limit; with "zero" the unscored samples score 0 (counted in reward/num_timeouts). 0: no budget."""

    on_error: Literal["raise", "zero"] = "raise"
    """A scorer that raises, or returns None, a string, a dict without "score", or a NaN/inf score:
    "raise" stops the run at the first such sample with its traceback and the sample; "zero" scores
    it 0, counts it in reward/num_errors and prints the first traceback once."""

    skip_special_tokens: bool = True
    """Drop special tokens (eos, pad, chat markers) when decoding responses for scoring."""

    countdown_last_line_only: bool = True
    """Countdown: search only the last line of the response for <answer> (TinyZero's rule);
    False searches the whole response."""

    gsm8k_method: str = "strict"
    """GSM8K answer extraction: "strict" (after "####") or "flexible" (the last number)."""

    num_examine: int = 0
    """Print this many decoded responses per data_source per call (rank 0), for eyeballing."""

    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping (off by default)."""

    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """How programs run for code rewards (codecontests, apps, codeforces, taco): limits, isolation, or
    a SandboxFusion server (veRL: reward_model.sandbox_fusion)."""

    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """An LLM as judge for the data_sources it names (off by default; see docs/judge.md)."""

    def __post_init__(self):
        if isinstance(self.judge, dict):
            self.judge = JudgeConfig(**self.judge)
        if isinstance(self.overlong_buffer, dict):
            self.overlong_buffer = OverlongBufferConfig(**self.overlong_buffer)
        if isinstance(self.sandbox, dict):
            self.sandbox = SandboxConfig(**self.sandbox)
        if self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0, got {self.num_workers}")
        if self.parallel_min_batch < 1:
            raise ValueError(f"reward.parallel_min_batch must be >= 1, got {self.parallel_min_batch}")
        if self.timeout_s < 0:
            raise ValueError(f"reward.timeout_s must be >= 0 (0 disables the limit), got {self.timeout_s}")
        if self.batch_timeout_s < 0:
            raise ValueError(f"reward.batch_timeout_s must be >= 0 (0 disables the budget), got {self.batch_timeout_s}")
        if self.on_error not in _ON_ERROR:
            raise ValueError(f"reward.on_error must be one of {_ON_ERROR}, got {self.on_error!r}")
        if self.gsm8k_method not in _GSM8K_METHODS:
            raise ValueError(f"reward.gsm8k_method must be one of {_GSM8K_METHODS}, got {self.gsm8k_method!r}")
        if self.num_examine < 0:
            raise ValueError(f"reward.num_examine must be >= 0, got {self.num_examine}")
        if self.custom_fn is not None:
            path, sep, name = self.custom_fn.rpartition(":")
            if not sep or not path or not name:
                raise ValueError(
                    f"reward.custom_fn must look like path/to/file.py:function_name, got {self.custom_fn!r}"
                )

    def scorer_options(self) -> dict:
        """Keyword options passed to built-in scorers."""
        return {"countdown_last_line_only": self.countdown_last_line_only, "gsm8k_method": self.gsm8k_method,
                "sandbox": self.sandbox}


@dataclass
class CustomRewardFunctionConfig:
    """A user reward function, as veRL's `custom_reward_function` section names it."""

    path: str | None = None
    """Python file holding the function. It is called for every sample as veRL calls it:
    `name(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)` (an
    `async def` works too), returning a score or a dict with "score" whose every key is kept as
    reward_extra_info. With reward_model.reward_manager=batch it is called once per batch with lists.
    None: the built-in scorers, chosen by data_source."""

    name: str = "compute_score"
    """Name of the function in `path`."""

    reward_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of every call (veRL: custom_reward_function.reward_kwargs); they win
    over the call's own arguments of the same name."""

    def __post_init__(self):
        if not isinstance(self.reward_kwargs, dict):
            raise ValueError(f"custom_reward_function.reward_kwargs must be a mapping of keyword arguments, got "
                             f"{type(self.reward_kwargs).__name__} {self.reward_kwargs!r:.100}")
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"custom_reward_function.name must be a function name, got {self.name!r}")

    def spec(self) -> str | None:
        """`path:name` (the form load_custom_fn takes), or None when no function is set."""
        return f"{self.path}:{self.name}" if self.path else None
