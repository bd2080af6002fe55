"""Per-role layouts through train.py: PPO with the actor at tp=2, the reference and the critic at sp=2
(and the other way round) on 2 CPU ranks trains exactly like the plain data-parallel run.

The rollout engine's layout is the same in all runs (one native engine per rank, same seeds), so the
samples are the same; the losses, gradient norms, KL and values of the training roles are then the
same computation over a different split of the work. Measured: every training metric of both steps
within rtol 2e-4 (fp32 on CPU; the differences come from summation order: reductions over the tp
and sp groups instead of inside one matmul).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tinyzero.trainer.loggers import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
pytestmark = pytest.mark.slow

# Metrics that depend on the layout's arithmetic; timings, throughput and memory are left out.
COMPARED = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/kl_loss", "actor/ppo_kl",
            "critic/vf_loss", "critic/grad_norm", "critic/vpred_mean", "critic/values/mean",
            "critic/returns/mean", "critic/advantages/mean", "critic/score/mean", "response_length/mean",
            "rollout_corr/kl")


def _run(root, name: str, model: str, *layout: str) -> list[dict]:
    out_dir = root / name
    args = ["--preset", "demo_cpu", f"--data.train_files={root}/data/train.parquet",
            f"--data.val_files={root}/data/test.parquet", f"--actor_rollout_ref.model.path={model}",
            f"--trainer.default_local_dir={out_dir}", "--trainer.plot=false", "--trainer.total_training_steps=2",
            "--trainer.test_freq=-1", "--trainer.save_freq=-1", "--trainer.val_before_train=false", "--data.train_batch_size=8",
            "--actor_rollout_ref.actor.ppo_mini_batch_size=4", "--critic.ppo_mini_batch_size=4",
            "--actor_rollout_ref.rollout.n=4", "--algorithm.adv_estimator=gae",
            "--actor_rollout_ref.actor.use_kl_loss=true", *layout]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), *args]
    out = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return [r for r in read_metrics(str(out_dir)) if r.get("step", 0) >= 1]


def test_per_role_layouts_train_like_data_parallel(tmp_path, tiny_model_dir):
    from tinyzero.demo import build_data

    build_data(str(tmp_path / "data"))
    plain = _run(tmp_path, "plain", tiny_model_dir)
    tp_actor = _run(tmp_path, "tp_actor", tiny_model_dir,
                    "--actor_rollout_ref.actor.tensor_model_parallel_size=2",
                    "--actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
                    "--critic.ulysses_sequence_parallel_size=2")
    sp_actor = _run(tmp_path, "sp_actor", tiny_model_dir,
                    "--actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                    "--actor_rollout_ref.ref.tensor_model_parallel_size=2",
                    "--critic.tensor_model_parallel_size=2", "--actor_rollout_ref.model.use_remove_padding=true",
                    "--critic.model.use_remove_padding=true")
    assert [r["step"] for r in plain] == [1, 2]
    for other, name in ((tp_actor, "tp_actor"), (sp_actor, "sp_actor")):
        assert [r["step"] for r in other] == [1, 2], name
        for want, got in zip(plain, other):
            for key in COMPARED:
                if key not in want:
                    continue
                assert math.isclose(got[key], want[key], rel_tol=2e-4, abs_tol=1e-6), \
                    (name, want["step"], key, want[key], got[key])
