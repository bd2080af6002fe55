"""Build a PPO trainer from the root config: pools and worker groups, data, rewards, loggers.

    trainer = build_ppo_trainer(cfg)   # every rank, after init_distributed()
    trainer.fit()

Placement ("pipeline.placement"): "colocate" puts actor/rollout/ref, critic and reward model in
one process per rank on one pool (create_colocated_worker_cls); "split" puts the policy on
the first ranks and critic + reward model on the rest, so the critic's values and update overlap
the policy's log-probs and update (PPOTrainer.forward_passes / update_models).
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyzero.config import Config
from tinyzero.data import RLHFDataset
from tinyzero.distributed import get_device, get_world_size
from tinyzero.plan import RunPlan
from tinyzero.rewards.manager import RewardManager
from tinyzero.single_controller import (
    ClassWithInitArgs,
    ResourcePool,
    WorkerGroup,
    create_colocated_worker_cls,
)
from tinyzero.trainer.ppo import PPOTrainer
from tinyzero.trainer.setup import make_tracker, plan_and_check, prepare_run, write_run_config
from tinyzero.workers.actor_worker import ActorRolloutRefWorker
from tinyzero.workers.critic_worker import CriticWorker
from tinyzero.workers.reward_model import RewardModelWorker
from tinyzero.workers.teacher import TeacherWorker, check_teacher_vocabulary


@dataclass
class Roles:
    """The worker groups a PPO step calls (critic / reward_model are None when not used)."""

    actor_rollout: WorkerGroup
    critic: WorkerGroup | None
    reward_model: WorkerGroup | None
    actor_rollout_dp_size: int
    rollout_dp_size: int
    teacher: WorkerGroup | None = None
    """On-policy distillation's frozen teacher (distill.teacher_path), else None."""


def role_classes(plan: RunPlan, policy_role: str) -> dict[str, ClassWithInitArgs]:
    """Each role's worker class with its section of the resolved config and its layout from the plan."""
    cfg = plan.config
    policy_dims = {k: plan.dims[k] for k in ("actor", "ref", "rollout") if k in plan.dims}
    classes = {"actor_rollout": ClassWithInitArgs(ActorRolloutRefWorker, cfg.actor_rollout_ref, policy_role,
                                                  dims=policy_dims,
                                                  rows_per_mini_batch=plan.rows_per_mini_batch["actor"])}
    if "critic" in plan.dims:
        classes["critic"] = ClassWithInitArgs(CriticWorker, cfg.critic, dims=plan.dims["critic"],
                                              rows_per_mini_batch=plan.rows_per_mini_batch["critic"])
    if "reward_model" in plan.dims:
        classes["reward_model"] = ClassWithInitArgs(RewardModelWorker, cfg.reward_model, dims=plan.dims["reward_model"])
    if "teacher" in plan.dims:
        classes["teacher"] = ClassWithInitArgs(TeacherWorker, cfg.actor_rollout_ref, cfg.distill,
                                               dims=plan.dims["teacher"])
    return classes


def build_roles(plan: RunPlan) -> Roles:
    """Create the pools and worker groups and initialise their models (critic and RM first, policy last)."""
    cfg = plan.config
    classes = role_classes(plan, "actor_rollout_ref" if cfg.use_reference else "actor_rollout")
    if cfg.pipeline.placement == "colocate":
        pool = ResourcePool(ranks=list(plan.pools["actor"]))
        wgs = WorkerGroup(resource_pool=pool, cls_with_init=create_colocated_worker_cls(classes)).spawn(
            prefix_set=set(classes))
    else:
        policy = classes.pop("actor_rollout")
        wgs = {"actor_rollout": WorkerGroup(resource_pool=ResourcePool(ranks=list(plan.pools["actor"])),
                                            cls_with_init=policy)}
        for name, cls in classes.items():
            wgs[name] = WorkerGroup(resource_pool=ResourcePool(ranks=list(plan.pools[name])), cls_with_init=cls)
    for name in ("critic", "reward_model", "teacher", "actor_rollout"):
        if name in wgs:
            wgs[name].init_model()
    return Roles(actor_rollout=wgs["actor_rollout"], critic=wgs.get("critic"), reward_model=wgs.get("reward_model"),
                 actor_rollout_dp_size=plan.dims["actor"].dp_size, rollout_dp_size=plan.dims["rollout"].dp_size,
                 teacher=wgs.get("teacher"))


def build_ppo_trainer(cfg: Config) -> PPOTrainer:
    """Everything a PPO run needs, on every rank (SPMD), after init_distributed()."""
    world_size = get_world_size()
    plan = plan_and_check(cfg, world_size)
    user_cfg, cfg = cfg, plan.config  # the roles run the resolved copy; config.yaml keeps what the user wrote
    if cfg.distill.enabled:  # before any model loads: a teacher of another vocabulary is refused in one line
        check_teacher_vocabulary(cfg.actor_rollout_ref.model, cfg.distill)
    run = prepare_run(cfg, RLHFDataset, {"actor_rollout_ref.actor.optim": cfg.actor_rollout_ref.actor.optim,
                                         "critic.optim": cfg.critic.optim})
    reward_args = (cfg.reward, cfg.custom_reward_function, cfg.reward_model.reward_manager,
                   cfg.reward_model.reward_kwargs)
    judge_ranks = None  # reward.judge.pool=split: the in-process judge on the ranks outside the policy pool
    if cfg.reward.judge.enable and cfg.reward.judge.pool == "split":
        judge_ranks = tuple(r for r in range(world_size) if r not in plan.pools["actor"])
    reward_fn = RewardManager(run.tokenizer, *reward_args, judge_ranks=judge_ranks)
    reward_fn.check_data_sources(_data_sources(run.train_dataset, run.val_dataset))
    val_reward_fn = RewardManager(run.tokenizer, *reward_args, judge_ranks=judge_ranks)
    run_dir = write_run_config(user_cfg, plan)
    trainer_cls, extra = PPOTrainer, {}
    if plan.asynchronous:  # rollout on its own pool, ahead of training
        from tinyzero.trainer.async_pipeline import AsyncPPOTrainer, build_async_roles

        roles, rollout, bridge = build_async_roles(plan)
        trainer_cls, extra = AsyncPPOTrainer, {"rollout": rollout, "bridge_ranks": bridge}
    else:
        roles = build_roles(plan)
    tracker = make_tracker(cfg, run_dir, run.total_steps)
    trainer = trainer_cls(cfg, roles, run.tokenizer, run.train_loader, run.val_dataset, reward_fn, val_reward_fn,
                          tracker, run.total_steps, world_size, get_device(), **extra)
    trainer.hf_config = plan.hf_config
    return trainer


def _data_sources(*datasets) -> list[str]:
    sources = set()
    for ds in datasets:
        if ds is not None and hasattr(ds, "data_sources"):
            sources.update(ds.data_sources)
    return sorted(sources)

