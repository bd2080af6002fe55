"""The start-up every trainer shares: input checks, tokenizer, datasets, step count, run folder, tracker.

    plan = plan_and_check(cfg, world_size)                 # layouts, batch sizes, model folder, data files
    cfg = plan.config                                      # the user's config with the derived values
    run = prepare_run(cfg, RLHFDataset, {"actor_rollout_ref.actor.optim": cfg.actor_rollout_ref.actor.optim})
    run_dir = write_run_config(user_cfg, plan)             # after the last check, before any role starts
    ...                                                    # the trainer's worker groups
    tracker = make_tracker(cfg, run_dir, run.total_steps)

The builders (trainer/builder.py for PPO, sft.py, rm.py, dpo.py) add their roles between these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from tinyzero.config import Config, ConfigError
from tinyzero.config.overrides import override
from tinyzero.config.parse import to_dict
from tinyzero.data import StatefulDataLoader
from tinyzero.distributed import get_rank, get_world_size, is_distributed, spans_nodes
from tinyzero.models.loading import check_model_path, load_hf_config, load_tokenizer
from tinyzero.plan import RunPlan, plan_run, with_model
from tinyzero.trainer.checkpoint import CheckpointManager
from tinyzero.trainer.loggers import Tracking
from tinyzero.trainer.run_config import write_config
from tinyzero.trainer.storage_check import check_shared_folder


@dataclass
class RunInputs:
    """What every trainer reads: the tokenizer, the datasets, the resumable train loader, the step count."""

    tokenizer: Any
    train_dataset: Any
    val_dataset: Any  # None without data.val_files
    train_loader: StatefulDataLoader
    total_steps: int


def plan_and_check(cfg: Config, world_size: int, read_model: bool = True) -> RunPlan:
    """The run plan (every layout and batch-size rule, tinyzero.plan), then the inputs every trainer needs
    before loading anything: the model folder and the data files. Returns the plan."""
    plan = plan_run(cfg, world_size)  # config errors first: they need nothing on disk
    check_inputs(plan.config)
    if read_model:
        model = plan.config.actor_rollout_ref.model
        plan = with_model(plan, load_hf_config(model.path, model.trust_remote_code, model.override_config))
    return plan


def check_inputs(cfg: Config) -> None:
    """The model folder and the data files exist."""
    check_model_path(cfg.actor_rollout_ref.model.path)
    # A missing file is reported by every rank that misses it (nodes may differ), not as a config error.
    for name, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for path in files:
            if not os.path.exists(path):
                raise ValueError(f"{name}: {path!r} does not exist; write it first (e.g. "
                                 f"python -m tinyzero.data.preprocess.countdown --out DIR) or fix the path")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty; pass --data.train_files PATH.parquet")


def total_training_steps(cfg: Config, batches_per_epoch: int) -> int:
    """Epochs x batches, capped by trainer.total_training_steps."""
    total = batches_per_epoch * cfg.trainer.total_epochs
    if cfg.trainer.total_training_steps is not None:
        total = min(total, cfg.trainer.total_training_steps) if batches_per_epoch else cfg.trainer.total_training_steps
    if total < 1:
        raise ConfigError(f"the run has no steps: {batches_per_epoch} batches per epoch of data.train_batch_size="
                         f"{cfg.data.train_batch_size}; lower the batch size or add data")
    return total


def prepare_run(cfg: Config, dataset_cls, optims: dict) -> RunInputs:
    """Tokenizer, datasets and loader; fills the total_training_steps of each optimizer config
    (`optims`: its field name -> the config) with the run's step count."""
    model = cfg.actor_rollout_ref.model
    tokenizer = load_tokenizer(model.resolved_tokenizer_path, model.trust_remote_code)
    train_ds = dataset_cls(cfg.data.train_files, tokenizer, cfg.data)
    val_ds = dataset_cls(cfg.data.val_files, tokenizer, cfg.data) if cfg.data.val_files else None
    loader = StatefulDataLoader(train_ds, batch_size=cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                seed=cfg.data.seed, drop_last=cfg.data.drop_last)
    total = total_training_steps(cfg, len(loader))
    for name, optim in optims.items():
        override(optim, "total_training_steps", total, f"{name}.total_training_steps",
                 "the learning-rate schedule spans the run's steps (set trainer.total_training_steps instead)")
    return RunInputs(tokenizer, train_ds, val_ds, loader, total)


def write_run_config(cfg: Config, plan: RunPlan | None = None) -> str:
    """Create the run folder and write config.yaml (the user's config, as asked for) and plan.yaml (what
    the run derived from it) on rank 0; returns the folder.

    A resume whose config changes the training is refused on every rank (trainer.run_config). A job on
    several nodes first checks that every rank sees one checkpoint folder (trainer.storage_check).
    """
    run_dir = cfg.trainer.default_local_dir
    if spans_nodes():  # every rank writes checkpoint shards there: all nodes must see one folder
        check_shared_folder(os.path.join(run_dir, "checkpoints"), "trainer.default_local_dir")
    error = [None]
    if get_rank() == 0:
        try:
            write_config(cfg, run_dir, _resumed_config_path(cfg))
            if plan is not None:
                write_plan(plan, run_dir)
        except ConfigError as e:
            error[0] = str(e)
    if is_distributed() and get_world_size() > 1:
        torch.distributed.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ConfigError(error[0])
    return run_dir


def write_plan(plan: RunPlan, run_dir: str) -> None:
    """RUN/plan.yaml: the pools, layouts, engine and batch shares the run derived (written atomically)."""
    import yaml

    path = os.path.join(run_dir, "plan.yaml")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        yaml.safe_dump(plan.summary(), f, sort_keys=False, default_flow_style=None)
    os.replace(tmp, path)


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


def make_tracker(cfg: Config, run_dir: str, total_steps: int) -> Tracking:
    """The run's loggers (rank 0 writes; the other ranks hold a disabled tracker)."""
    return Tracking(run_dir, cfg.trainer.logger, total_steps=total_steps, project=cfg.trainer.project_name,
                    experiment=cfg.trainer.experiment_name, config=to_dict(cfg),
                    progress_bar=cfg.trainer.progress_bar, enabled=get_rank() == 0)
