"""A run's curves (reward, validation score, response length, KL, throughput, losses) as one PNG.

`plot_run(run_dir)` reads RUN_DIR/metrics.jsonl and draws one panel per group of metrics the run
logged; the trainer calls it at the end of a run (trainer.plot), `python -m tinyzero.plot` on demand.
Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import os

from tinyzero.trainer.loggers import read_metrics

__all__ = ["PANELS", "plot_run"]

# (panel title, metric names or prefixes ending in "/")
PANELS = (
    ("reward", ("critic/score/mean", "critic/rewards/mean")),
    ("validation (val-core)", ("val-core/",)),
    ("response length", ("response_length/mean", "response_length/max")),
    ("KL", ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty", "critic/kl")),
    ("entropy", ("actor/entropy",)),
    ("losses", ("actor/pg_loss", "critic/vf_loss", "train/loss", "val/loss")),
    ("accuracy", ("train/acc", "val/acc", "train/rewards/accuracies", "val/rewards/accuracies")),
    ("DPO implicit rewards", ("train/rewards/margins", "val/rewards/margins", "train/rewards/chosen",
                              "train/rewards/rejected")),
    ("throughput (tokens/s/rank)", ("perf/throughput",)),
)


def _series(rows: list[dict], name: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        v = row.get(name)
        if isinstance(v, (int, float)):
            xs.append(int(row["step"]))
            ys.append(float(v))
    return xs, ys


def _names(rows: list[dict], spec: tuple[str, ...]) -> list[str]:
    present = {k for row in rows for k in row}
    out = []
    for s in spec:
        out.extend(sorted(k for k in present if k.startswith(s)) if s.endswith("/") else ([s] if s in present else []))
    return out


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Write the curves PNG for RUN_DIR and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no steps yet; nothing to plot")
    panels = [(title, _names(rows, spec)) for title, spec in PANELS]
    panels = [(t, n) for t, n in panels if n]
    cols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.2 * nrows), squeeze=False)
    for ax, (title, names) in zip(axes.flat, panels):
        for name in names:
            xs, ys = _series(rows, name)
            ax.plot(xs, ys, marker="o" if len(xs) < 12 else None, markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
