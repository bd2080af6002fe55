"""SFT, and the trainer of single-model runs (SFT, RM): one train_step per batch in the shared loop (loop.py).

    torchrun --nproc_per_node 8 train.py sft --preset sft --data.train_files data/sft/train.parquet

The data is a parquet of prompt/response rows (or chat messages, data.messages_key); the loss is
the mean negative log-likelihood of the response tokens (prompt tokens are masked). The model,
optimizer and sharding come from actor_rollout_ref (model / actor.optim / actor.fsdp_config);
the run folder gets metrics.jsonl, checkpoints and the HF export (RUN/hf_model).
"""

from __future__ import annotations

from tinyzero.config import Config
from tinyzero.data import SFTDataset
from tinyzero.data.loader import collate_to_dataproto
from tinyzero.distributed import get_world_size
from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from tinyzero.trainer.loggers import Tracking
from tinyzero.trainer.loop import Driver, pop_metrics
from tinyzero.trainer.metrics import timer
from tinyzero.trainer.setup import make_tracker, plan_and_check, prepare_run, write_run_config
from tinyzero.workers.supervised import SupervisedWorker


class SupervisedTrainer(Driver):
    """The step of SFT and RM training (the worker's loss decides which) in the shared loop."""

    def __init__(self, config: Config, wg, loader, val_dataset, tracker: Tracking, total_steps: int):
        super().__init__(config, loader, val_dataset, tracker, total_steps)
        self.wg = wg

    @property
    def loader(self):
        return self.train_loader

    def step(self) -> dict[str, float]:
        timing = {}
        with timer("step", timing):
            metrics = self.train_step(self.next_train_batch())
        self._check_finite(metrics, ("train/loss", "train/grad_norm"), "train/num_skipped_steps")
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        metrics["training/epoch"] = float(self.train_loader.epoch)
        return metrics

    def train_step(self, batch) -> dict[str, float]:
        """One optimizer step on a global batch; returns its metrics (the same on every rank)."""
        return pop_metrics(self.wg.train_step(batch))

    def eval_step(self, batch) -> dict[str, float]:
        """Validation metrics of one global batch."""
        return pop_metrics(self.wg.eval_step(batch))

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

    def save_roles(self, tmp: str) -> None:
        self.wg.save_checkpoint(f"{tmp}/model", self.global_step)

    def load_roles(self, step_dir: str, state: dict) -> None:
        self.wg.load_checkpoint(f"{step_dir}/model")

    def export_hf(self, out_dir: str) -> None:
        self.wg.export_hf(out_dir)


def build_supervised_trainer(cfg: Config, mode: str, dataset_cls) -> SupervisedTrainer:
    """Datasets, the worker group (mode "sft" or "rm"), loggers; every rank."""
    world_size = get_world_size()
    plan = plan_and_check(cfg, world_size)
    user_cfg, cfg = cfg, plan.config
    arr = cfg.actor_rollout_ref
    run = prepare_run(cfg, dataset_cls, {"actor_rollout_ref.actor.optim": arr.actor.optim})
    run_dir = write_run_config(user_cfg, plan)
    wg = WorkerGroup(resource_pool=ResourcePool(ranks=list(plan.pools["actor"])),
                     cls_with_init=ClassWithInitArgs(SupervisedWorker, arr, mode, dims=plan.dims["actor"]))
    wg.init_model()
    tracker = make_tracker(cfg, run_dir, run.total_steps)
    return SupervisedTrainer(cfg, wg, run.train_loader, run.val_dataset, tracker, run.total_steps)


def build_sft_trainer(cfg: Config) -> SupervisedTrainer:
    return build_supervised_trainer(cfg, "sft", SFTDataset)
