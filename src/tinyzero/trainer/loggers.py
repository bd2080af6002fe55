"""Where metrics go: a console line + progress bar with ETA, metrics.jsonl, samples.jsonl, TensorBoard, W&B.

    tracker = Tracking(run_dir, ["console", "jsonl"], total_steps=100, config=cfg_dict)
    tracker.start(step=0)          # or the first step after a resume
    tracker.log({"critic/score/mean": 0.4, ...}, step=3)
    tracker.log_samples([{"prompt": ..., "response": ..., "score": 1.0}], step=3)
    tracker.close()

Only rank 0 writes (pass `enabled=False` elsewhere). metrics.jsonl holds one JSON object per
logged step ({"step": N, name: value, ...}); a resumed run drops the lines of steps it will redo
and appends, so the file always reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

# The few numbers worth a glance in the per-step console line: (metric, short label).
CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("val-core/mean@", "val"),  # the first data_source's core mean@N (see ConsoleLogger.log)
    ("actor/pg_loss", "pg"),
    ("actor/ppo_kl", "kl"),
    ("actor/kl_loss", "kl_loss"),
    ("critic/vf_loss", "vf"),
    ("actor/entropy", "ent"),
    ("response_length/mean", "len"),
    ("train/loss", "loss"),
    ("val/loss", "val_loss"),
    ("train/acc", "acc"),
    ("val/acc", "val_acc"),
    ("train/rewards/accuracies", "acc"),
    ("val/rewards/accuracies", "val_acc"),
    ("train/rewards/margins", "margin"),
    ("timing_s/step", "s/step"),
)


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class ConsoleLogger:
    """A compact line per step, led by a progress bar with elapsed time and ETA."""

    def __init__(self, total_steps: int, progress_bar: bool = True, stream=None):
        self.total = max(int(total_steps), 1)
        self.start_step = 0
        self.progress_bar = progress_bar
        self.stream = stream or sys.stdout
        self.t0 = time.monotonic()

    def start(self, step: int) -> None:
        self.start_step = step
        self.t0 = time.monotonic()

    def bar(self, step: int, width: int = 20) -> str:
        frac = min(max(step / self.total, 0.0), 1.0)
        filled = int(round(frac * width))
        done = step - self.start_step
        elapsed = time.monotonic() - self.t0
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        eta_s = _fmt_duration(eta) if math.isfinite(eta) else "?"
        return f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} {_fmt_duration(elapsed)}<{eta_s}"

    def log(self, data: dict, step: int) -> None:
        parts = [self.bar(step)] if self.progress_bar else [f"step {step}/{self.total}"]
        val_keys = [k for k in data if k.startswith("val-core/") and "/mean@" in k]
        for key, label in CONSOLE_KEYS:
            if key == "val-core/mean@" and val_keys:
                key = val_keys[0]
            if key in data:
                parts.append(f"{label} {data[key]:.4g}")
        print(" | ".join(parts), file=self.stream, flush=True)


class JsonlLogger:
    """metrics.jsonl: one JSON object per step; `start(step)` drops lines of steps >= step (a resume)."""

    def __init__(self, path: str):
        self.path = path
        self.f = None

    def start(self, step: int) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if os.path.exists(self.path):
            _truncate_from_step(self.path, step)
        self.f = open(self.path, "a")

    def log(self, data: dict, step: int) -> None:
        if self.f is None:
            self.start(0)
        row = {"step": step, **{k: _jsonable(v) for k, v in data.items()}}
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if hasattr(v, "item"):
        return v.item()
    return v


def _truncate_from_step(path: str, start_step: int) -> None:
    """Drop lines logged for steps >= start_step (they are redone after a resume)."""
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if int(json.loads(line).get("step", -1)) < start_step:
                    keep.append(line)
            except (ValueError, AttributeError):
                continue  # a torn last line from a killed run
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


class TensorBoardLogger:
    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir)

    def log(self, data: dict, step: int) -> None:
        for k, v in data.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, project: str, name: str, config: dict | None, run_dir: str):
        import wandb

        self.run = wandb.init(project=project, name=name, config=config, dir=run_dir, resume="allow")

    def log(self, data: dict, step: int) -> None:
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracking:
    """Fans metrics out to the configured loggers (rank 0 only)."""

    def __init__(self, run_dir: str, loggers: list[str], total_steps: int, project: str = "tinyzero", experiment: str = "run", config: dict | None = None,
                 progress_bar: bool = True, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = run_dir
        self.backends = []
        self.samples_path = os.path.join(run_dir, "samples.jsonl")
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        for name in loggers:
            if name == "console":
                self.backends.append(ConsoleLogger(total_steps, progress_bar))
            elif name == "jsonl":
                self.backends.append(JsonlLogger(os.path.join(run_dir, "metrics.jsonl")))
            elif name == "tensorboard":
                self.backends.append(_optional("tensorboard", lambda: TensorBoardLogger(
                    os.path.join(run_dir, "tensorboard"))))
            elif name == "wandb":
                self.backends.append(_optional("wandb", lambda: WandbLogger(project, experiment, config, run_dir)))
        self.backends = [b for b in self.backends if b is not None]

    def start(self, step: int) -> None:
        """Begin logging at `step`: lines a previous attempt wrote for steps >= step are dropped."""
        if not self.enabled:
            return
        if os.path.exists(self.samples_path):
            _truncate_from_step(self.samples_path, step)
        for b in self.backends:
            if hasattr(b, "start"):
                b.start(step)

    def log(self, data: dict, step: int) -> None:
        for b in self.backends:
            b.log(data, step)

    def log_samples(self, rows: list[dict], step: int, split: str = "train") -> None:
        if not self.enabled or not rows:
            return
        with open(self.samples_path, "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, "split": split, **{k: _jsonable(v) for k, v in row.items()}}) + "\n")

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        for b in self.backends:
            if hasattr(b, "close"):
                b.close()
        self.backends = []


def _optional(name: str, make):
    try:
        return make()
    except ImportError:
        print(f"[tinyzero] logger {name!r} asked for but not installed; skipping it", file=sys.stderr)
        return None


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl (the last row wins when a step appears twice)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            rows.setdefault(int(row.get("step", 0)), {}).update(row)
    return [rows[k] for k in sorted(rows)]
