"""The `reliability` section: what a run does when something goes wrong.

Time limits on collectives and on progress (the hang watchdog), saving on SIGTERM / SIGINT, what a
non-finite step does, and which changed settings a resume accepts. None of them changes what a run
computes when nothing goes wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ReliabilityConfig"]


@dataclass
class ReliabilityConfig:
    """Faults, hangs, signals and resumes (tinyzero.runtime.progress, trainer.preemption, trainer.run_config)."""

    collective_timeout_s: float = 1800.0
    """Timeout of every collective (the world group and every pool's groups): a rank that stops
    taking part makes its peers fail after this long. TINYZERO_COLLECTIVE_TIMEOUT_S overrides it."""
    hang_timeout_s: float = 300.0
    """Progress watchdog: when a rank reports no progress (a step phase, a micro-batch, generated
    tokens, scored samples) for this long while its main thread sits still outside a collective, or
    stops answering (SIGSTOP), every rank dumps its Python stacks and the job ends naming the stuck
    rank, its phase and its last progress. Start-up (model loading) is not watched. 0 disables it
    (e.g. under a debugger)."""
    save_on_signal: bool = True
    """On SIGTERM / SIGINT (Slurm and Kubernetes send SIGTERM before killing): finish the current step,
    save a checkpoint on every rank, and exit non-zero saying so. A second signal stops at once.
    Every trainer mode (ppo, sft, rm, dpo): they share one loop."""
    signal_grace_s: float = 25.0
    """After a SIGTERM / SIGINT, the most seconds to wait for the end of the step and its save; past it
    the job exits without saving (the last checkpoint stays intact). Keep it below the scheduler's
    kill delay (torchrun and Kubernetes: 30 s; Slurm: --signal=TERM@SECONDS)."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """On a non-finite loss or gradient norm: "stop" raises (the last checkpoint stays intact), "skip"
    drops the batch's update and continues."""
    allow_config_change: str = ""
    """Resuming with changes to settings that alter the training (batch sizes, learning rates, seeds,
    model path, ...) is refused; list the fields to accept anyway, comma-separated
    ("data.train_batch_size,actor_rollout_ref.actor.optim.lr"), or "all"."""

    def __post_init__(self):
        from tinyzero.config.root import ConfigError

        if not self.collective_timeout_s > 0:
            raise ConfigError(f"reliability.collective_timeout_s must be > 0 seconds (got {self.collective_timeout_s})")
        if not self.hang_timeout_s >= 0:
            raise ConfigError(f"reliability.hang_timeout_s must be >= 0 seconds, 0 to disable the watchdog "
                              f"(got {self.hang_timeout_s})")
        if not self.signal_grace_s > 0:
            raise ConfigError(f"reliability.signal_grace_s must be > 0 seconds (got {self.signal_grace_s}); turn "
                              "saving on signals off with reliability.save_on_signal=false instead")
        if not isinstance(self.allow_config_change, str):
            raise ConfigError("reliability.allow_config_change must be a comma-separated string of field names or "
                              f"'all' (got {self.allow_config_change!r})")
