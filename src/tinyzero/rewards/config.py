"""RewardConfig: how rule-based rewards are computed (the `reward` section of the root config)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RewardConfig"]

_GSM8K_METHODS = ("strict", "flexible")


@dataclass
class RewardConfig:
    custom_fn: str | None = None
    """A user reward function `path/to/file.py:function_name` with signature
    `(data_source, solution_str, ground_truth, extra_info) -> float | dict`; it replaces the
    built-in scorers for every data_source. None uses the built-in registry."""

    num_workers: int = 2
    """Processes used to score large batches in parallel; 0 always scores in-process."""

    parallel_min_batch: int = 2048
    """Batches with fewer samples than this are scored in-process (a pool only pays on big batches)."""

    timeout_s: float = 10.0
    """Per-sample time limit; a scorer that runs longer (or raises) gives 0 and is counted in
    reward/num_timeouts (reward/num_errors). 0 disables the limit. Enforced with SIGALRM, so only
    when scoring runs in a main thread (the trainer's, or a pool worker's)."""

    skip_special_tokens: bool = True
    """Drop special tokens (eos, pad, chat markers) when decoding responses for scoring."""

    countdown_last_line_only: bool = True
    """Countdown: search only the last line of the response for <answer> (TinyZero's rule);
    False searches the whole response."""

    gsm8k_method: str = "strict"
    """GSM8K answer extraction: "strict" (after "####") or "flexible" (the last number)."""

    num_examine: int = 0
    """Print this many decoded responses per data_source per call (rank 0), for eyeballing."""

    def __post_init__(self):
        if self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0, got {self.num_workers}")
        if self.parallel_min_batch < 1:
            raise ValueError(f"reward.parallel_min_batch must be >= 1, got {self.parallel_min_batch}")
        if self.timeout_s < 0:
            raise ValueError(f"reward.timeout_s must be >= 0 (0 disables the limit), got {self.timeout_s}")
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
        return {"countdown_last_line_only": self.countdown_last_line_only, "gsm8k_method": self.gsm8k_method}
