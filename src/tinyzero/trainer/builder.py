"""Build a PPO trainer from the root config: pools and worker groups, data, rewards, loggers.

    trainer = build_ppo_trainer(cfg)   # every rank, after init_distributed()
    trainer.fit()

Placement ("trainer.placement"): "colocate" puts actor/rollout/ref, critic and reward model in
one process per rank on one pool (create_colocated_worker_cls); "split" puts the policy on
the first ranks and critic + reward model on the rest, so the critic's values and update overlap
the policy's log-probs and update (PPOTrainer.forward_passes / update_models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tinyzero.config import Config, ConfigError, check_model_context, pool_sizes, sync_derived_fields
from tinyzero.data import RLHFDataset
from tinyzero.distributed import get_device, get_world_size
from tinyzero.models.loading import load_hf_config
from tinyzero.rewards.manager import RewardManager
from tinyzero.single_controller import (
    ClassWithInitArgs,
    ResourcePool,
    WorkerGroup,
    create_colocated_worker_cls,
)
from tinyzero.trainer.ppo import PPOTrainer
from tinyzero.trainer.setup import check_inputs, make_tracker, prepare_run, write_run_config
from tinyzero.workers.actor_worker import ActorRolloutRefWorker
from tinyzero.workers.config import rollout_dims
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


def build_roles(cfg: Config, world_size: int) -> Roles:
    """Create the pools and worker groups and initialise their models (critic and RM first, policy last)."""
    actor_ranks, _ = pool_sizes(cfg, world_size)
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
    arr = cfg.actor_rollout_ref
    return Roles(actor_rollout=wgs["actor_rollout"], critic=wgs.get("critic"), reward_model=wgs.get("reward_model"),
                 actor_rollout_dp_size=arr.actor.parallel_dims(actor_ranks).dp_size,
                 rollout_dp_size=rollout_dims(arr.rollout, actor_ranks).dp_size)


def prepare_config(cfg: Config, world_size: int):
    """Start-up checks that need the world size and the model's config; returns the model's HF config."""
    sync_derived_fields(cfg)
    check_inputs(cfg, world_size)
    model = cfg.actor_rollout_ref.model
    hf_config = load_hf_config(model.path, model.trust_remote_code, model.override_config)
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_pos:
        check_model_context(cfg, int(max_pos))
    check_model_layouts(cfg, world_size, hf_config)
    return hf_config


def check_model_layouts(cfg: Config, world_size: int, hf_config) -> None:
    """Each role's tensor / sequence parallel degrees must split the model's heads and sizes; checked
    before anything starts, with the setting to change. (The critic starts from the same model.)"""
    from tinyzero.models.tensor_parallel import check_tensor_parallel
    from tinyzero.models.ulysses import check_heads

    arr = cfg.actor_rollout_ref
    actor_ranks, critic_ranks = pool_sizes(cfg, world_size)
    roles = [(arr.actor, actor_ranks)] + [(arr.ref, actor_ranks)] * cfg.use_reference
    roles += [(cfg.critic, critic_ranks)] * cfg.use_critic
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for section, ranks in roles:
        dims = section.parallel_dims(ranks)
        try:
            check_tensor_parallel(hf_config, dims.tp, f"{dims.section}.tensor_model_parallel_size")
            if dims.sp > 1:
                check_heads(heads // dims.tp, max(kv_heads // dims.tp, 1), dims.sp)
        except ValueError as e:
            raise ConfigError(f"{dims.section}: {e}") from None


def build_ppo_trainer(cfg: Config) -> PPOTrainer:
    """Everything a PPO run needs, on every rank (SPMD), after init_distributed()."""
    world_size = get_world_size()
    hf_config = prepare_config(cfg, world_size)
    run = prepare_run(cfg, RLHFDataset, {"actor_rollout_ref.actor.optim": cfg.actor_rollout_ref.actor.optim,
                                         "critic.optim": cfg.critic.optim})
    reward_args = (cfg.reward, cfg.custom_reward_function, cfg.reward_model.reward_manager,
                   cfg.reward_model.reward_kwargs)
    reward_fn = RewardManager(run.tokenizer, *reward_args)
    reward_fn.check_data_sources(_data_sources(run.train_dataset, run.val_dataset))
    val_reward_fn = RewardManager(run.tokenizer, *reward_args)
    run_dir = write_run_config(cfg)
    trainer_cls, extra = PPOTrainer, {}
    if cfg.trainer.max_staleness or cfg.trainer.rollout_pool_size:  # rollout on its own pool, ahead of training
        from tinyzero.trainer.async_pipeline import AsyncPPOTrainer, build_async_roles

        roles, rollout, bridge = build_async_roles(cfg, world_size)
        trainer_cls, extra = AsyncPPOTrainer, {"rollout": rollout, "bridge_ranks": bridge}
    else:
        roles = build_roles(cfg, world_size)
    tracker = make_tracker(cfg, run_dir, run.total_steps)
    trainer = trainer_cls(cfg, roles, run.tokenizer, run.train_loader, run.val_dataset, reward_fn, val_reward_fn,
                          tracker, run.total_steps, world_size, get_device(), **extra)
    trainer.hf_config = hf_config
    return trainer


def _data_sources(*datasets) -> list[str]:
    sources = set()
    for ds in datasets:
        if ds is not None and hasattr(ds, "data_sources"):
            sources.update(ds.data_sources)
    return sorted(sources)

