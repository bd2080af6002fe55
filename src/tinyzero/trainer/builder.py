"""Build a PPO trainer from the root config: pools and worker groups, data, rewards, loggers.

    trainer = build_ppo_trainer(cfg)   # every rank, after init_distributed()
    trainer.fit()

Placement ("trainer.placement"): "colocate" puts actor/rollout/ref, critic and reward model in
one process per rank on one pool (create_colocated_worker_cls); "split" puts the policy on
the first ranks and critic + reward model on the rest, so their work overlaps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from tinyzero.config import (
    Config,
    ConfigError,
    check_model_context,
    check_world,
    pool_sizes,
    sync_derived_fields,
    to_dict,
)
from tinyzero.data import RLHFDataset, StatefulDataLoader
from tinyzero.distributed import get_device, get_rank, get_world_size, is_distributed
from tinyzero.models.loading import check_model_path, load_hf_config, load_tokenizer
from tinyzero.rewards.manager import RewardManager
from tinyzero.single_controller import (
    ClassWithInitArgs,
    ResourcePool,
    WorkerGroup,
    create_colocated_worker_cls,
)
from tinyzero.trainer.checkpoint import CheckpointManager
from tinyzero.trainer.loggers import Tracking
from tinyzero.trainer.ppo import PPOTrainer
from tinyzero.trainer.run_config import write_config
from tinyzero.workers.actor_worker import ActorRolloutRefWorker
from tinyzero.workers.critic_worker import CriticWorker
from tinyzero.workers.reward_model import RewardModelWorker


@dataclass
class Roles:
    """The worker groups a PPO step calls (critic / reward_model are None when not used)."""

    actor_rollout: Any
    critic: Any
    reward_model: Any
    actor_rollout_dp_size: int
    rollout_dp_size: int


def total_training_steps(cfg: Config, batches_per_epoch: int) -> int:
    """Epochs x batches, capped by trainer.total_training_steps."""
    total = batches_per_epoch * cfg.trainer.total_epochs
    if cfg.trainer.total_training_steps is not None:
        total = min(total, cfg.trainer.total_training_steps) if batches_per_epoch else cfg.trainer.total_training_steps
    if total < 1:
        raise ConfigError(f"the run has no steps: {batches_per_epoch} batches per epoch of data.train_batch_size="
                         f"{cfg.data.train_batch_size}; lower the batch size or add data")
    return total


def build_datasets(cfg: Config, tokenizer, dataset_cls):
    """(train dataset, val dataset or None, the resumable train loader, total steps) of any trainer."""
    train_ds = dataset_cls(cfg.data.train_files, tokenizer, cfg.data)
    val_ds = dataset_cls(cfg.data.val_files, tokenizer, cfg.data) if cfg.data.val_files else None
    loader = StatefulDataLoader(train_ds, batch_size=cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                seed=cfg.data.seed, drop_last=cfg.data.drop_last)
    return train_ds, val_ds, loader, total_training_steps(cfg, len(loader))


def write_run_config(cfg: Config) -> str:
    """Create the run folder and write the resolved config.yaml (rank 0); returns the folder.

    A resume whose config changes the training is refused on every rank (trainer.run_config).
    """
    run_dir = cfg.trainer.default_local_dir
    error = [None]
    if get_rank() == 0:
        try:
            write_config(cfg, run_dir, _resumed_config_path(cfg))
        except ConfigError as e:
            error[0] = str(e)
    if is_distributed() and get_world_size() > 1:
        torch.distributed.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ConfigError(error[0])
    return run_dir


def _resumed_config_path(cfg: Config) -> str | None:
    """The config.yaml of the run this one resumes, or None when it starts fresh."""
    trainer = cfg.trainer
    if trainer.resume_mode == "resume_path":
        return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(trainer.resume_from_path))),
                            "config.yaml")
    if trainer.resume_mode == "auto" and CheckpointManager(os.path.join(trainer.default_local_dir,
                                                                        "checkpoints")).checkpoints():
        return os.path.join(trainer.default_local_dir, "config.yaml")
    return None


def build_roles(cfg: Config, world_size: int) -> Roles:
    """Create the pools and worker groups and initialise their models (critic and RM first, policy last)."""
    actor_ranks, critic_ranks = pool_sizes(cfg, world_size)
    arr_role = "actor_rollout_ref" if cfg.use_reference else "actor_rollout"
    policy = ClassWithInitArgs(ActorRolloutRefWorker, cfg.actor_rollout_ref, arr_role)
    others = {}
    if cfg.use_critic:
        others["critic"] = ClassWithInitArgs(CriticWorker, cfg.critic)
    if cfg.reward_model.enable:
        others["reward_model"] = ClassWithInitArgs(RewardModelWorker, cfg.reward_model)
    if cfg.trainer.placement == "colocate":
        pool = ResourcePool(ranks=list(range(world_size)))
        classes = {"actor_rollout": policy, **others}
        wgs = WorkerGroup(resource_pool=pool, cls_with_init=create_colocated_worker_cls(classes)).spawn(
            prefix_set=set(classes))
    else:
        policy_pool = ResourcePool(ranks=list(range(actor_ranks)))
        other_pool = ResourcePool(ranks=list(range(actor_ranks, world_size)))
        wgs = {"actor_rollout": WorkerGroup(resource_pool=policy_pool, cls_with_init=policy)}
        for name, cls in others.items():
            wgs[name] = WorkerGroup(resource_pool=other_pool, cls_with_init=cls)
    for name in ("critic", "reward_model", "actor_rollout"):
        if name in wgs:
            wgs[name].init_model()
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    del critic_ranks
    return Roles(actor_rollout=wgs["actor_rollout"], critic=wgs.get("critic"), reward_model=wgs.get("reward_model"),
                 actor_rollout_dp_size=actor_ranks, rollout_dp_size=actor_ranks // tp)


def prepare_config(cfg: Config, world_size: int):
    """Start-up checks that need the world size and the model's config; returns the model's HF config."""
    sync_derived_fields(cfg)
    check_world(cfg, world_size)
    arr = cfg.actor_rollout_ref
    check_model_path(arr.model.path)
    hf_config = load_hf_config(arr.model.path, arr.model.trust_remote_code, arr.model.override_config)
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_pos:
        check_model_context(cfg, int(max_pos))
    # A missing file is reported by every rank that misses it (nodes may differ), not as a config error.
    for name, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for path in files:
            if not os.path.exists(path):
                raise ValueError(f"{name}: {path!r} does not exist; write it first (e.g. "
                                 f"python -m tinyzero.data.preprocess.countdown --out DIR) or fix the path")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty; pass --data.train_files PATH.parquet")
    return hf_config


def build_ppo_trainer(cfg: Config) -> PPOTrainer:
    """Everything a PPO run needs, on every rank (SPMD), after init_distributed()."""
    world_size = get_world_size()
    hf_config = prepare_config(cfg, world_size)
    arr = cfg.actor_rollout_ref
    tokenizer = load_tokenizer(arr.model.resolved_tokenizer_path, arr.model.trust_remote_code)
    train_ds, val_ds, loader, total = build_datasets(cfg, tokenizer, RLHFDataset)
    for optim in (arr.actor.optim, cfg.critic.optim):
        optim.total_training_steps = total
    reward_fn = RewardManager(tokenizer, cfg.reward)
    reward_fn.check_data_sources(_data_sources(train_ds, val_ds))
    val_reward_fn = RewardManager(tokenizer, cfg.reward)
    run_dir = write_run_config(cfg)
    roles = build_roles(cfg, world_size)
    tracker = Tracking(run_dir, cfg.trainer.logger, total_steps=total, project=cfg.trainer.project_name,
                       experiment=cfg.trainer.experiment_name, config=to_dict(cfg),
                       progress_bar=cfg.trainer.progress_bar, enabled=get_rank() == 0)
    trainer = PPOTrainer(cfg, roles, tokenizer, loader, val_ds, reward_fn, val_reward_fn, tracker, total,
                         world_size, get_device())
    trainer.hf_config = hf_config
    return trainer


def _data_sources(*datasets) -> list[str]:
    sources = set()
    for ds in datasets:
        if ds is not None and hasattr(ds, "data_sources"):
            sources.update(ds.data_sources)
    return sorted(sources)

