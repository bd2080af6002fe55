"""The `pipeline` section: where the roles run, and how far rollout may run ahead of training.

One pool holds every role unless `placement` splits the critic and reward model off, or
`max_staleness` / `rollout_pool_size` give generation a pool of its own (the asynchronous pipeline,
tinyzero.trainer.async_pipeline). The run plan (tinyzero.plan) turns these into ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["PipelineConfig"]


@dataclass
class PipelineConfig:
    """Placement of the roles on the ranks and the asynchronous pipeline."""

    placement: Literal["colocate", "split"] = "colocate"
    """"colocate": actor/rollout, ref, critic and reward model share every rank (one process per rank
    holds them all). "split": actor/rollout/ref on the first `actor_pool_size` ranks, critic and
    reward model on the rest; the critic's values and update run while the policy pool computes
    log-probs and updates the actor."""
    actor_pool_size: int = 0
    """Split placement only: ranks of the actor pool (0 = half the world)."""
    max_staleness: int = 0
    """Asynchronous RL (tinyzero.trainer.async_pipeline): the rollout pool generates up to this many
    batches ahead of the trainer pool, so samples are at most this many actor updates old (1 =
    veRL's one-step off-policy). 0 (default): on-policy; the synchronous loop unless
    rollout_pool_size > 0. Needs an off-policy correction (actor_rollout_ref.actor.tis_imp_ratio_cap
    > 0 or actor_rollout_ref.rollout.use_rollout_log_probs=true) unless allow_uncorrected_staleness."""
    rollout_pool_size: int = 0
    """Ranks of the rollout pool of the asynchronous pipeline (the last ranks; actor, reference and
    critic share the others). 0 = half the world when max_staleness > 0; > 0 with max_staleness=0
    runs the pipeline on-policy (generation and training take turns on their own pools)."""
    allow_uncorrected_staleness: bool = False
    """Accept max_staleness > 0 without an off-policy correction (stale samples trained as on-policy)."""
    rollout_rs_threshold: float = 0.0
    """Asynchronous pipeline: sequence-level masked importance sampling (veRL's rollout rejection,
    seq_mean_k1). A response whose geometric-mean ratio exp(mean_t(log pi_old - log pi_rollout))
    leaves [1/threshold, threshold] is masked out of the update; the trainer's old log-probs are then
    computed in their own pass. 0 = off; e.g. 2.0. Logged as rollout_corr/rollout_rs_seq_masked_fraction
    (responses dropped) and rollout_corr/rollout_rs_masked_fraction (their share of the tokens)."""
    partial_rollout: bool = False
    """Asynchronous pipeline (max_staleness > 0): partial rollouts. A generation running while the
    trainer pool updates decodes in segments of partial_rollout_chunk tokens and takes the new weights
    at the first segment boundary after they are sent, continuing the unfinished rows under them
    (tinyzero.rollout.partial). Each token records the version that sampled it
    (rollout_token_versions) and keeps the rollout log-prob of that version. Off: a generation runs
    on the weights it started with."""
    partial_rollout_chunk: int = 64
    """Partial rollouts: new tokens per decoding segment (each later segment re-prefills prompt +
    response so far); smaller takes new weights sooner at the cost of more prefills."""

    def __post_init__(self):
        from tinyzero.config.root import ConfigError

        for name in ("max_staleness", "rollout_pool_size", "rollout_rs_threshold"):
            if getattr(self, name) < 0:
                raise ConfigError(f"pipeline.{name} must be >= 0 (got {getattr(self, name)})")
        if self.partial_rollout_chunk < 1:
            raise ConfigError(f"pipeline.partial_rollout_chunk must be >= 1 (got {self.partial_rollout_chunk}); "
                              "e.g. 64 new tokens per decoding segment")
