"""The training and scoring roles as single-controller workers (FSDP2).

    ActorRolloutRefWorker(config: ActorRolloutRefConfig, role)   actor / rollout / ref and their combinations
    CriticWorker(config: CriticConfig)                            value model
    RewardModelWorker(config: RewardModelConfig)                  sequence-classification reward model

Configs live in tinyzero.workers.config; the per-rank computations (PPOActor, PPOCritic)
in actor.py / critic.py, independent of the worker plumbing.
"""

from tinyzero.workers.config import (
    ActorConfig,
    ActorRolloutRefConfig,
    CriticConfig,
    OptimConfig,
    RefConfig,
    RewardModelConfig,
)

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "ActorRolloutRefWorker",
    "CriticConfig",
    "CriticWorker",
    "OptimConfig",
    "RefConfig",
    "RewardModelConfig",
    "RewardModelWorker",
]


def __getattr__(name: str):
    # Workers import the distributed stack; load them on first use only.
    if name == "ActorRolloutRefWorker":
        from tinyzero.workers.actor_worker import ActorRolloutRefWorker

        return ActorRolloutRefWorker
    if name == "CriticWorker":
        from tinyzero.workers.critic_worker import CriticWorker

        return CriticWorker
    if name == "RewardModelWorker":
        from tinyzero.workers.reward_model import RewardModelWorker

        return RewardModelWorker
    raise AttributeError(f"module 'tinyzero.workers' has no attribute {name!r}")
