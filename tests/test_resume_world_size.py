"""Resume on another world size through train.py: 2 ranks -> 1 rank -> 2 ranks, metrics continuing.

Three `torchrun train.py` runs share one run folder with the tiny model: 2 ranks train steps 1-2,
1 rank resumes from the step-2 checkpoint (resharded by DCP) and trains 3-4, 2 ranks resume from
step 4 and train 5-6. Checked: metrics.jsonl holds each step 1..6 once, in order, with finite
losses (a run that failed to resume would start again at step 1); every step trained on the
prompts the seeded sampler gives an uninterrupted run (from samples.jsonl, all rows logged), so
the data position survives both world-size changes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter

import pytest

from tests.test_e2e_train import ENV, ROOT
from tinyzero.trainer.loggers import read_metrics

BATCH, N = 8, 2
pytestmark = pytest.mark.slow


def _train(ranks: int, steps: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           os.path.join(ROOT, "train.py"), *args, f"--trainer.total_training_steps={steps}"]
    out = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{ranks} ranks to step {steps}:\n" + out.stdout[-3000:] + out.stderr[-6000:]


def _expected_prompts(train_file: str, seed: int, steps: int) -> list[Counter]:
    """The prompts of steps 1..steps of an uninterrupted run (the loader's seeded order, epoch 0)."""
    import pyarrow.parquet as pq

    from tinyzero.data.loader import StatefulSampler

    rows = pq.read_table(train_file).to_pylist()
    sampler = StatefulSampler(len(rows), BATCH, shuffle=True, seed=seed, drop_last=True)
    assert steps <= len(sampler)
    return [Counter(rows[i]["prompt"][-1]["content"] for i in sampler.batch_indices(0, k) for _ in range(N))
            for k in range(steps)]


def test_resume_two_one_two_ranks(tmp_path, tiny_model_dir):
    from tinyzero.cli import load_preset
    from tinyzero.demo import build_data

    build_data(str(tmp_path / "data"))
    run = tmp_path / "run"
    args = ["--preset", "demo_cpu", f"--data.train_files={tmp_path}/data/train.parquet",
            f"--data.val_files={tmp_path}/data/test.parquet", f"--actor_rollout_ref.model.path={tiny_model_dir}",
            f"--trainer.default_local_dir={run}", f"--data.train_batch_size={BATCH}",
            f"--actor_rollout_ref.rollout.n={N}", "--actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "--trainer.save_freq=2", "--trainer.test_freq=-1", "--trainer.val_before_train=false",
            f"--trainer.log_samples={BATCH * N}", "--trainer.export_hf=false", "--trainer.plot=false"]
    _train(2, 2, args)
    _train(1, 4, args)
    _train(2, 6, args)

    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert r["training/global_step"] == r["step"]
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"]), r
    samples = [json.loads(line) for line in open(run / "samples.jsonl")]
    seen = [Counter(s["prompt"].strip() for s in samples if s["split"] == "train" and s["step"] == k)
            for k in range(1, 7)]
    expected = _expected_prompts(f"{tmp_path}/data/train.parquet", load_preset("demo_cpu").data.seed, 6)
    assert seen == expected
    lines = [json.loads(x)["step"] for x in open(run / "metrics.jsonl")]
    assert lines == [1, 2, 3, 4, 5, 6]
