"""The driver loop every trainer shares (PPO family, SFT, RM, DPO): step -> validate -> log -> save.

    class MyTrainer(Driver):
        def step(self) -> dict: ...                       # one training step's metrics (every rank)
        def validate(self) -> dict: ...
        def save_roles(self, tmp: str) -> None: ...       # roles write their shards into the step folder
        def load_roles(self, step_dir: str, state: dict) -> None: ...
        def export_hf(self, out_dir: str) -> None: ...
    MyTrainer(cfg, loader, val_dataset, tracker, total_steps).fit()

`fit()` is the table of contents; the trainers differ only in what one step, the validation,
the role checkpoints and the export do. Resume, the step counter, the non-finite guard, the
save-on-signal stop and the log-before-save order live here once.
"""

from __future__ import annotations

import math
import os

from tinyzero.agent.metrics import agent_metrics
from tinyzero.protocol import DataProto
from tinyzero.runtime.progress import report_progress
from tinyzero.trainer.checkpoint import (
    CheckpointManager,
    load_trainer_state,
    save_trainer_state,
    verify_checkpoint,
)
from tinyzero.trainer.metrics import merge_worker_metrics
from tinyzero.trainer.preemption import finish as finish_on_signal
from tinyzero.trainer.preemption import stop_requested


class NonFiniteError(RuntimeError):
    """A loss or gradient norm was NaN/inf; the step's update was not applied."""


def pop_metrics(out: DataProto) -> dict[str, float]:
    """Take a worker output's meta_info["metrics"] out (so it does not collide in union) and reduce it.
    A multi-turn rollout's agent/* metrics come from its rows' counters, over every rank's rows (meta_info
    is the first rank's only)."""
    return {**merge_worker_metrics([out.meta_info.pop("metrics", {})]), **agent_metrics(out.non_tensor_batch)}


def draw_curves(run_dir: str, tracker) -> None:
    """RUN/curves.png, when matplotlib is installed and there is something to draw."""
    try:
        from tinyzero.trainer.curves import plot_run

        tracker.print(f"[tinyzero] curves: {plot_run(run_dir)}")
    except (ImportError, ValueError, OSError) as e:
        tracker.print(f"[tinyzero] no curves drawn: {e}")


class Driver:
    """Owns the step counter, the train loader's position, checkpoints and logging of one run."""

    def __init__(self, config, train_loader, val_dataset, tracker, total_steps: int):
        self.config = config
        self.train_loader = train_loader
        self.val_dataset = val_dataset
        self.tracker = tracker
        self.total_steps = total_steps
        self.global_step = 0
        self.ckpt = CheckpointManager(os.path.join(config.trainer.default_local_dir, "checkpoints"),
                                      keep_last=config.trainer.max_ckpt_to_keep)
        self._batches = None

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train to `total_steps`; returns the last step's metrics (with the final validation)."""
        self.load_checkpoint()
        last: dict[str, float] = {}
        trainer = self.config.trainer
        if trainer.val_before_train and self.global_step == 0 and self.val_dataset is not None:
            last = self.validate()
            self.tracker.log(last, step=0)
            if trainer.val_only:
                return last
        while self.global_step < self.total_steps:
            self.global_step += 1
            report_progress("step", step=self.global_step)
            metrics = self.step()
            metrics.update(self.maybe_validate())
            # Log before saving: a kill in between redoes the step from the previous checkpoint
            # (the resumed run drops the step's line), never leaves a checkpoint without its line.
            self.tracker.log(metrics, step=self.global_step)
            saved = self.maybe_save()
            self.stop_if_signalled(saved)
            last = metrics
        if trainer.export_hf:
            self.export_hf(os.path.join(trainer.default_local_dir, "hf_model"))
        return last

    def close(self) -> None:
        """Flush the loggers and draw the curves (rank 0)."""
        self.tracker.close()
        if self.config.trainer.plot and self.tracker.enabled:
            draw_curves(self.config.trainer.default_local_dir, self.tracker)

    def next_train_batch(self) -> DataProto:
        """The next training batch; epochs roll over inside, resumable through the loader's state."""
        if self._batches is None:
            self._batches = self._iterate()
        return next(self._batches)

    def _iterate(self):
        while True:
            yield from self.train_loader

    # ------------------------------------------------------------------ what a trainer defines
    def step(self) -> dict[str, float]:
        """One training step (self.global_step is already advanced); its metrics, the same on every rank."""
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        raise NotImplementedError

    def save_roles(self, tmp: str) -> None:
        """Write the roles' state (and any other per-step files) into the step's temporary folder."""
        raise NotImplementedError

    def load_roles(self, step_dir: str, state: dict) -> None:
        """Restore what save_roles wrote (and the trainer_state extras of extra_state)."""
        raise NotImplementedError

    def extra_state(self) -> dict:
        """Trainer-state entries beyond the step and the data position."""
        return {}

    def export_hf(self, out_dir: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ validation, non-finite guard
    def maybe_validate(self) -> dict[str, float]:
        freq = self.config.trainer.test_freq
        last = self.global_step == self.total_steps
        if self.val_dataset is None or not (last or (freq > 0 and self.global_step % freq == 0)):
            return {}
        return self.validate()

    def _check_finite(self, metrics: dict, names: tuple[str, ...], skipped_key: str) -> None:
        bad = [n for n in names if n in metrics and not math.isfinite(metrics[n])]
        if metrics.get(skipped_key, 0) > 0:
            bad.append(f"{skipped_key}={metrics[skipped_key]:g}")
        if not bad:
            return
        msg = (f"step {self.global_step}: non-finite {', '.join(bad)}; the optimizer step was not applied")
        if self.config.reliability.nonfinite == "stop":
            raise NonFiniteError(f"{msg}. {self._checkpoint_situation()}; lower the learning rate, check the "
                                 "data, or set --reliability.nonfinite skip to drop such batches")
        self.tracker.print(f"[tinyzero] warning: {msg}; skipping the batch (reliability.nonfinite=skip)")

    def _checkpoint_situation(self) -> str:
        """Which sealed checkpoint a restart would resume from (none yet is said plainly)."""
        for step, path in self.ckpt.checkpoints():
            if verify_checkpoint(path, checksum=False) is None:
                return f"The last checkpoint, step {step} in {path}, is intact: a restart resumes from it"
        return (f"No checkpoint has been saved in {self.ckpt.root} (trainer.save_freq="
                f"{self.config.trainer.save_freq}): a restart begins from step 0")

    # ------------------------------------------------------------------ checkpoints
    def maybe_save(self) -> bool:
        freq = self.config.trainer.save_freq
        if self.global_step == self.total_steps or (freq > 0 and self.global_step % freq == 0):
            self.save_checkpoint()
            return True
        return False

    def stop_if_signalled(self, saved: bool) -> None:
        """After SIGTERM/SIGINT on any rank (reliability.save_on_signal): save this step unless done, then stop."""
        signame = stop_requested()
        if signame is not None and self.global_step < self.total_steps:
            if not saved:
                self.save_checkpoint()
            raise finish_on_signal(signame, self.global_step, self.ckpt.root)

    def save_checkpoint(self) -> None:
        """Roles write their shards into a temporary folder; the manager seals it (atomic rename)."""
        with self.ckpt.saving(self.global_step) as tmp:
            self.save_roles(tmp)
            save_trainer_state(tmp, {"global_step": self.global_step, "dataloader": self.train_loader.state_dict(),
                                     **self.extra_state()})

    def load_checkpoint(self) -> None:
        """resume_mode auto / resume_path: restore the roles, the data position and the step."""
        trainer = self.config.trainer
        resume = trainer.resume_from_path if trainer.resume_mode == "resume_path" else trainer.resume_mode
        step_dir = self.ckpt.resolve_resume(resume)
        if step_dir is None:
            self.tracker.start(0)
            return
        state = load_trainer_state(step_dir)
        self.load_roles(step_dir, state)
        self.train_loader.load_state_dict(state["dataloader"])
        self.global_step = int(state["global_step"])
        self.tracker.start(self.global_step + 1)
        self.tracker.print(f"[tinyzero] resumed from {step_dir} (step {self.global_step})")
