"""End to end on 2 CPU ranks: the non-finite guard, restarts under `torchrun --max-restarts`, placements.

Faults are injected through a user reward function (`--reward.custom_fn`), written by the test:
it scores the "a+b=" task exactly, and once the run's step-2 checkpoint is sealed it either returns
NaN (scoring must stop the run at step 3 naming the sample and leave checkpoint 2 usable) or kills
rank 0 once (torchrun restarts the job, which resumes from checkpoint 2 and must end with the
metrics of a run that was never interrupted). An entropy coefficient of 1e38 makes the gradient norm
non-finite at step 1: the non-finite guard stops the run, saying that no checkpoint exists yet.
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

REWARD = '''
"""Test reward: exact "a+b=" scoring, with a fault once the step-2 checkpoint exists."""
import os


def score(data_source, solution_str, ground_truth, extra_info=None):
    sealed = os.path.exists(os.environ["FAULT_AFTER"])
    mode = os.environ.get("FAULT_MODE", "none")
    if sealed and mode == "nan":
        return float("nan")
    if sealed and mode == "crash" and os.environ.get("RANK") == "0" and not os.path.exists(os.environ["CRASHED"]):
        open(os.environ["CRASHED"], "w").close()
        os.kill(os.getppid(), 9)  # the rank (user functions run in its scoring worker processes)
        os._exit(1)
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    from tinyzero.demo import build_data

    root = tmp_path_factory.mktemp("guards")
    build_data(str(root / "data"))
    (root / "reward.py").write_text(REWARD)
    return root


def launch(root, run: str, *extra: str, fault: str = "none", restarts: int = 0, model: str = ""):
    """torchrun train.py (demo preset, 4 GRPO steps, checkpoint every 2) with a fault mode."""
    run_dir = root / run
    env = {**ENV, "FAULT_AFTER": str(run_dir / "checkpoints" / "global_step_2" / "COMPLETE.json"),
           "FAULT_MODE": fault, "CRASHED": str(root / f"{run}.crashed")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={restarts}", os.path.join(ROOT, "train.py"), "--preset", "demo_cpu",
           f"--data.train_files={root}/data/train.parquet", "--data.val_files",
           f"--actor_rollout_ref.model.path={model}", f"--trainer.default_local_dir={run_dir}",
           f"--reward.custom_fn={root}/reward.py:score", "--data.train_batch_size=16",
           "--actor_rollout_ref.rollout.n=4", "--trainer.total_training_steps=4", "--trainer.save_freq=2",
           "--trainer.val_before_train=false", "--trainer.plot=false", "--trainer.progress_bar=false",
           "--trainer.export_hf=false", *extra]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _ok(out):
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


def test_nan_reward_stops_at_scoring_then_on_error_zero_finishes(setup, tiny_model_dir):
    out = launch(setup, "nan", fault="nan", model=tiny_model_dir)
    assert out.returncode != 0
    assert "not finite: nan" in out.stderr and "failed on sample 0 (data_source 'arithmetic'" in out.stderr, \
        out.stderr[-4000:]
    ckpts = setup / "nan" / "checkpoints"
    assert (ckpts / "global_step_2" / "COMPLETE.json").exists()
    assert not any(p.name.startswith("global_step_3") or p.name.startswith("global_step_4")
                   for p in ckpts.iterdir() if (p / "COMPLETE.json").exists())
    assert [r["step"] for r in read_metrics(str(setup / "nan"))] == [1, 2]
    # The same command with reward.on_error=zero resumes from the intact checkpoint, scoring NaN as 0.
    out = launch(setup, "nan", "--reward.on_error=zero", "--reliability.allow_config_change=reward.on_error", fault="nan",
                 model=tiny_model_dir)
    _ok(out)
    rows = read_metrics(str(setup / "nan"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["reward/num_errors"] for r in rows[2:]] == [64.0, 64.0]
    assert "failed to score and score 0" in out.stderr


def test_nonfinite_loss_stops_saying_no_checkpoint_exists_then_skip_mode_finishes(setup, tiny_model_dir):
    blow_up = ["--actor_rollout_ref.actor.entropy_coeff=1e38"]  # the gradient norm overflows at step 1
    out = launch(setup, "blowup", *blow_up, model=tiny_model_dir)
    assert out.returncode != 0
    assert "step 1: non-finite actor/grad_norm" in out.stderr, out.stderr[-4000:]
    assert "No checkpoint has been saved in" in out.stderr and "is intact" not in out.stderr, out.stderr[-4000:]
    assert "Traceback" not in out.stderr.split("stopped:")[0][-2000:]
    assert not os.path.exists(setup / "blowup" / "metrics.jsonl") or read_metrics(str(setup / "blowup")) == []
    out = launch(setup, "blowup", *blow_up, "--reliability.nonfinite=skip", model=tiny_model_dir)
    _ok(out)
    rows = read_metrics(str(setup / "blowup"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["actor/num_skipped_steps"] >= 1 for r in rows)
    assert "skipping the batch" in out.stdout


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing", "perf/"))}


def test_max_restarts_resume_matches_uninterrupted(setup, tiny_model_dir):
    """PPO with a critic, a reference and an adaptive in-reward KL: every piece of state must come back."""
    ppo = ["--algorithm.adv_estimator=gae", "--critic.ppo_mini_batch_size=8", "--critic.optim.lr=1e-3",
           "--algorithm.use_kl_in_reward=true", "--algorithm.kl_ctrl.type=adaptive",
           "--algorithm.kl_ctrl.target_kl=0.01", "--algorithm.kl_ctrl.horizon=4", "--algorithm.kl_ctrl.kl_coef=0.05"]
    (setup / "ref.crashed").write_text("")  # the reference run never crashes
    _ok(launch(setup, "ref", *ppo, fault="crash", model=tiny_model_dir))
    out = launch(setup, "restarted", *ppo, fault="crash", restarts=1, model=tiny_model_dir)
    _ok(out)
    assert (setup / "restarted.crashed").exists(), "the fault was never injected"
    assert "resumed from" in out.stdout
    ref, got = read_metrics(str(setup / "ref")), read_metrics(str(setup / "restarted"))
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4]
    coefs = [r["actor/reward_kl_penalty_coeff"] for r in ref]
    assert len(set(coefs)) == 4, coefs  # the adaptive coefficient moves every step (state to restore)
    for a, b in zip(ref, got):
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])), (a["step"], k, a[k], b[k])


def test_split_and_colocated_placements_both_train(setup, tiny_model_dir):
    """PPO with a critic on one pool (colocated) and on two pools (split): both run with finite, sane metrics."""
    ppo = ["--algorithm.adv_estimator=gae", "--critic.ppo_mini_batch_size=8", "--trainer.total_training_steps=2",
           "--trainer.save_freq=-1"]
    # Validation with 4 samples per prompt (best@4, worst@4) after the last step.
    val = [f"--data.val_files={setup}/data/test.parquet", "--actor_rollout_ref.rollout.val_kwargs.n=4",
           "--actor_rollout_ref.rollout.val_kwargs.do_sample=true",
           "--actor_rollout_ref.rollout.val_kwargs.temperature=1.0"]
    rows = {}
    for placement in ("colocate", "split"):
        _ok(launch(setup, placement, *ppo, *val, f"--pipeline.placement={placement}", model=tiny_model_dir))
        rows[placement] = read_metrics(str(setup / placement))
    for placement, got in rows.items():
        assert [r["step"] for r in got] == [1, 2]
        last = got[-1]
        reward = {k.split("/reward/", 1)[1]: v for k, v in last.items()
                  if k.startswith(("val-core/arithmetic/reward/", "val-aux/arithmetic/reward/"))}
        assert reward["best@4/mean"] >= reward["mean@4"] >= reward["worst@4/mean"], reward
        assert {"best@2/mean", "std@4", "worst@2/std"} <= set(reward), reward
        for r in got:
            for k in ("critic/vf_loss", "actor/pg_loss", "critic/score/mean", "critic/values/mean"):
                assert math.isfinite(r[k]), (placement, k, r[k])
            assert 0.0 <= r["critic/score/mean"] <= 1.0
