"""SFT (and the shared driver of single-model trainers): batches -> train_step -> validate -> save.

    torchrun --nproc_per_node 8 train.py sft --preset sft --data.train_files data/sft/train.parquet

The data is a parquet of prompt/response rows (or chat messages, data.messages_key); the loss is
the mean negative log-likelihood of the response tokens (prompt tokens are masked). The model,
optimizer and sharding come from actor_rollout_ref (model / actor.optim / actor.fsdp_config);
the run folder gets metrics.jsonl, checkpoints and the HF export (RUN/hf_model).
"""

from __future__ import annotations

import math
import os

from tinyzero.config import Config, ConfigError, check_world, to_dict
from tinyzero.data import SFTDataset
from tinyzero.data.loader import collate_to_dataproto
from tinyzero.distributed import get_rank, get_world_size
from tinyzero.models.loading import check_model_path, load_tokenizer
from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from tinyzero.trainer.builder import build_datasets, write_run_config
from tinyzero.trainer.checkpoint import CheckpointManager, load_trainer_state, save_trainer_state
from tinyzero.trainer.loggers import Tracking
from tinyzero.trainer.metrics import timer
from tinyzero.trainer.ppo import NonFiniteError, draw_curves, pop_metrics
from tinyzero.trainer.supervised import SupervisedWorker


class SupervisedTrainer:
    """The loop of SFT and RM training (the worker's loss decides which)."""

    def __init__(self, config: Config, wg, loader, val_dataset, tracker: Tracking, total_steps: int):
        self.config, self.wg, self.loader, self.val_dataset = config, wg, loader, val_dataset
        self.tracker, self.total_steps = tracker, total_steps
        self.global_step = 0
        self.ckpt = CheckpointManager(os.path.join(config.trainer.default_local_dir, "checkpoints"),
                                      keep_last=config.trainer.max_ckpt_to_keep)

    def fit(self) -> dict[str, float]:
        self.load_checkpoint()
        trainer, last = self.config.trainer, {}
        if trainer.val_before_train and self.global_step == 0 and self.val_dataset is not None:
            last = self.validate()
            self.tracker.log(last, step=0)
        batches = self._iterate()
        while self.global_step < self.total_steps:
            self.global_step += 1
            timing = {}
            with timer("step", timing):
                metrics = self.train_step(next(batches))
            self._check_finite(metrics)
            metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
            metrics["training/epoch"] = float(self.loader.epoch)
            freq = trainer.test_freq
            if self.val_dataset is not None and (self.global_step == self.total_steps
                                                 or (freq > 0 and self.global_step % freq == 0)):
                metrics.update(self.validate())
            self.tracker.log(metrics, step=self.global_step)  # before the save (see PPOTrainer.fit)
            if self.global_step == self.total_steps or (trainer.save_freq > 0
                                                        and self.global_step % trainer.save_freq == 0):
                self.save_checkpoint()
            last = metrics
        if trainer.export_hf:
            self.wg.export_hf(os.path.join(trainer.default_local_dir, "hf_model"))
        return last

    def train_step(self, batch) -> dict[str, float]:
        """One optimizer step on a global batch; returns its metrics (the same on every rank)."""
        return pop_metrics(self.wg.train_step(batch))

    def eval_step(self, batch) -> dict[str, float]:
        """Validation metrics of one global batch."""
        return pop_metrics(self.wg.eval_step(batch))

    def _iterate(self):
        while True:
            yield from self.loader

    def _check_finite(self, metrics: dict) -> None:
        bad = [k for k in ("train/loss", "train/grad_norm") if not math.isfinite(metrics.get(k, 0.0))]
        if not bad:
            return
        msg = f"step {self.global_step}: non-finite {bad}; the optimizer step was not applied"
        if self.config.trainer.nonfinite == "stop":
            raise NonFiniteError(msg + f". The last checkpoint in {self.ckpt.root} is intact")
        self.tracker.print(f"[tinyzero] warning: {msg} (trainer.nonfinite=skip)")

    def validate(self) -> dict[str, float]:
        """Mean validation metrics (rows beyond a multiple of the world size are left out)."""
        ws = self.wg.world_size
        size = self.config.data.val_batch_size or len(self.val_dataset)
        size = max(ws, size - size % ws)
        sums, weight = {}, 0
        for start in range(0, len(self.val_dataset) - len(self.val_dataset) % ws, size):
            idx = range(start, min(start + size, len(self.val_dataset) - len(self.val_dataset) % ws))
            batch = collate_to_dataproto([self.val_dataset[i] for i in idx])
            for k, v in self.eval_step(batch).items():
                sums[k] = sums.get(k, 0.0) + v * len(idx)
            weight += len(idx)
        return {k: v / max(weight, 1) for k, v in sums.items()}

    def save_checkpoint(self) -> None:
        tmp = self.ckpt.begin_save(self.global_step)
        self.wg.save_checkpoint(f"{tmp}/model", self.global_step)
        save_trainer_state(tmp, {"global_step": self.global_step, "dataloader": self.loader.state_dict()})
        self.ckpt.finalize(self.global_step, tmp)

    def load_checkpoint(self) -> None:
        t = self.config.trainer
        step_dir = self.ckpt.resolve_resume(t.resume_from_path if t.resume_mode == "resume_path" else t.resume_mode)
        if step_dir is None:
            self.tracker.start(0)
            return
        state = load_trainer_state(step_dir)
        self.wg.load_checkpoint(f"{step_dir}/model")
        self.loader.load_state_dict(state["dataloader"])
        self.global_step = int(state["global_step"])
        self.tracker.start(self.global_step + 1)
        self.tracker.print(f"[tinyzero] resumed from {step_dir} (step {self.global_step})")

    def close(self) -> None:
        self.tracker.close()
        if self.config.trainer.plot and self.tracker.enabled:
            draw_curves(self.config.trainer.default_local_dir, self.tracker)


def build_supervised_trainer(cfg: Config, mode: str, dataset_cls) -> SupervisedTrainer:
    """Datasets, the worker group (mode "sft" or "rm"), loggers; every rank."""
    world_size = get_world_size()
    check_world(cfg, world_size)
    arr = cfg.actor_rollout_ref
    check_model_path(arr.model.path)
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty; pass --data.train_files PATH.parquet")
    tokenizer = load_tokenizer(arr.model.resolved_tokenizer_path, arr.model.trust_remote_code)
    _, val_ds, loader, total = build_datasets(cfg, tokenizer, dataset_cls)
    arr.actor.optim.total_training_steps = total
    run_dir = write_run_config(cfg)
    wg = WorkerGroup(resource_pool=ResourcePool(ranks=list(range(world_size))),
                     cls_with_init=ClassWithInitArgs(SupervisedWorker, arr, mode))
    wg.init_model()
    tracker = Tracking(run_dir, cfg.trainer.logger, total_steps=total, project=cfg.trainer.project_name,
                       experiment=cfg.trainer.experiment_name, config=to_dict(cfg),
                       progress_bar=cfg.trainer.progress_bar, enabled=get_rank() == 0)
    return SupervisedTrainer(cfg, wg, loader, val_ds, tracker, total)


def build_sft_trainer(cfg: Config) -> SupervisedTrainer:
    return build_supervised_trainer(cfg, "sft", SFTDataset)
