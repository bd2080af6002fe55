"""The asynchronous pipeline (pipeline.max_staleness): 2 CPU ranks, 1 rollout + 1 trainer, tiny model.

Through train.py: K=1 runs with finite metrics, staleness 0 then 1 (never above K), the rollout
engine holding the trainer's weights after every update (checksums, and zero rollout/trainer
log-prob gap on the on-policy first step), a kill + resume that reproduces the uninterrupted run;
the on-policy pipeline bit-identical to the synchronous loop;
in process: a failure inside generation on the rollout pool ends every rank with its traceback;
config errors; the weight bridge moves every dtype bit for bit in any bucket size. Budget: about
125 s on an idle 2-core machine.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.dist_utils import run_distributed
from tinyzero.trainer.loggers import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
# A reward that varies between samples (the parity of the text), so every update changes the weights.
REWARD = '''
def score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 2)
'''


def _cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            os.path.join(ROOT, "train.py"), *args]


def _args(root, model: str, run: str, *extra: str) -> list[str]:
    return ["--preset", "demo_cpu", f"--data.train_files={root}/data/train.parquet",
            f"--data.val_files={root}/data/test.parquet", f"--actor_rollout_ref.model.path={model}",
            f"--trainer.default_local_dir={root}/{run}", f"--reward.custom_fn={root}/reward.py:score",
            "--actor_rollout_ref.rollout.n=4", "--data.train_batch_size=8",
            "--actor_rollout_ref.actor.ppo_mini_batch_size=8", "--trainer.val_before_train=true",
            "--trainer.test_freq=-1", "--trainer.plot=false", "--trainer.logger=jsonl",
            "--pipeline.max_staleness=1", "--actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",
            "--trainer.total_training_steps=4", "--trainer.save_freq=2", *extra]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    from tinyzero.demo import build_data

    root = tmp_path_factory.mktemp("async")
    build_data(str(root / "data"))
    (root / "reward.py").write_text(REWARD)
    return root, tiny_model_dir


@pytest.fixture(scope="module")
def full_run(setup):
    root, model = setup
    out = subprocess.run(_cmd(_args(root, model, "full")), env=ENV, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = read_metrics(str(root / "full"))
    # validation on the rollout pool
    assert rows[0]["step"] == 0 and any(k.startswith("val-core/arithmetic/") for k in rows[0])
    return rows


@pytest.mark.slow
def test_one_step_off_policy_through_train_py(full_run):
    rows = full_run[1:]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "async/trainer_idle_frac", "async/rollout_idle_frac"):
            assert math.isfinite(r[key]), (r["step"], key, r[key])
        assert r["async/staleness/max"] <= 1
        # The engine holds exactly the weights the trainer sent after this step's update.
        assert r["async/weight_checksum/rollout"] == pytest.approx(r["async/weight_checksum/trainer"], rel=1e-9)
        assert r["async/weight_version"] == r["step"]
    # Step 1 is the warm-up (generated and trained at version 0); a save at step 2 drains the queue,
    # so step 3 starts the pipeline again: staleness 0, 1, 0, 1.
    assert [r["async/staleness/mean"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert [r["async/queue_depth"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    # On-policy steps: the engine sampled with the trainer's weights, so its log-probs are the trainer's
    # (fp32 on CPU, tolerance 1e-5); the stale step differs.
    assert rows[0]["training/rollout_probs_diff_max"] < 1e-5
    assert rows[2]["training/rollout_probs_diff_max"] < 1e-5
    assert rows[1]["training/rollout_probs_diff_max"] > 1e-4
    checksums = [r["async/weight_checksum/trainer"] for r in rows]
    assert len(set(checksums)) == len(checksums), "the weights did not change between updates"


@pytest.mark.slow
def test_kill_and_resume_reproduce_the_uninterrupted_run(setup, full_run):
    root, model = setup
    args = _args(root, model, "killed")
    proc = subprocess.Popen(_cmd(args), env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    marker = root / "killed" / "checkpoints" / "global_step_2" / "COMPLETE.json"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run never wrote its step-2 checkpoint"
    out = subprocess.run(_cmd(args), env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    resumed = read_metrics(str(root / "killed"))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for a, b in zip(full_run, resumed):
        keys = [k for k in a if not k.startswith(("timing", "perf/", "async/trainer_idle", "async/rollout_idle",
                                                  "reward/parallel"))]
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k, a[k], b[k])


@pytest.mark.slow
def test_on_policy_pipeline_equals_the_synchronous_loop(setup):
    """max_staleness=0 on 1 trainer + 1 rollout rank vs the synchronous loop on 1 rank (the same training
    layout): every metric but the timings is bit-identical at every step."""
    root, model = setup
    common = ["--pipeline.max_staleness=0", "--actor_rollout_ref.actor.tis_imp_ratio_cap=-1",
              "--trainer.total_training_steps=3", "--trainer.save_freq=-1", "--trainer.val_before_train=false",
              "--trainer.export_hf=false", "--actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    runs = {}
    for name, ranks, extra in (("sync", 1, []), ("pipeline", 2, ["--pipeline.rollout_pool_size=1"])):
        cmd = _cmd(_args(root, model, name, *common, *extra))
        cmd[cmd.index("--nproc_per_node=2")] = f"--nproc_per_node={ranks}"
        out = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
        runs[name] = read_metrics(str(root / name))
    assert [r["step"] for r in runs["sync"]] == [r["step"] for r in runs["pipeline"]] == [1, 2, 3]
    for a, b in zip(runs["sync"], runs["pipeline"]):
        keys = [k for k in a if not k.startswith(("timing", "perf/", "reward/parallel"))]
        assert len(keys) > 20
        assert {k: b.get(k) for k in keys} == {k: a[k] for k in keys}, a["step"]
        assert b["async/staleness/max"] == 0


def _generation_fails_on_rollout_pool(argv: list[str]):
    from tinyzero.cli import parse_args
    from tinyzero.distributed import get_rank, init_distributed
    from tinyzero.single_controller.failure import RemoteWorkerError
    from tinyzero.trainer.builder import build_ppo_trainer

    cfg = parse_args(argv)
    init_distributed(60)
    trainer = build_ppo_trainer(cfg)

    def explode(prompts):
        raise RuntimeError("the engine exploded while generating")

    if trainer.rollout_wg.is_local:
        trainer.rollout_wg.worker.rollout.generate_sequences = explode
    try:
        trainer.fit()
    except RemoteWorkerError as e:
        return get_rank(), str(e)
    return get_rank(), None


@pytest.mark.slow
def test_a_failure_in_generation_ends_every_rank_with_its_traceback(setup):
    root, model = setup
    argv = _args(root, model, "fails", "--trainer.resume_mode=disable", "--trainer.val_before_train=false")
    results = run_distributed(_generation_fails_on_rollout_pool, 2, argv, timeout=180,
                              env={"CUDA_VISIBLE_DEVICES": "", "TINYZERO_ABORT_GRACE_S": "60"})
    for rank, message in results:
        assert message is not None, f"rank {rank} finished without an error"
        assert "the engine exploded while generating" in message, (rank, message)
        assert "generate_sequences" in message, (rank, message)


def _config(**settings):
    from configs.demo import demo_cpu
    from tinyzero.config import check_config

    cfg = demo_cpu()
    for k, v in settings.items():
        section, name = k.split("__")
        setattr(getattr(cfg, section) if section != "rollout" else cfg.actor_rollout_ref.rollout, name, v)
    check_config(cfg)
    return cfg


def test_config_errors_name_the_fix():
    from tinyzero.config import ConfigError, PipelineConfig

    with pytest.raises(ConfigError, match=r"tis_imp_ratio_cap=2.0.*use_rollout_log_probs=true.*allow_uncorrected"):
        _config(pipeline__max_staleness=1)
    _config(pipeline__max_staleness=1, pipeline__allow_uncorrected_staleness=True)
    _config(pipeline__max_staleness=2, rollout__use_rollout_log_probs=True)
    _config(pipeline__rollout_pool_size=1)  # the on-policy pipeline needs no correction
    with pytest.raises(ConfigError, match="rollout.name=native"):
        _config(pipeline__max_staleness=1, rollout__use_rollout_log_probs=True, rollout__name="vllm")
    with pytest.raises(ConfigError, match="pipeline.placement=colocate"):
        _config(pipeline__max_staleness=1, rollout__use_rollout_log_probs=True, pipeline__placement="split")
    _config(pipeline__max_staleness=1, pipeline__rollout_rs_threshold=2.0)  # masking alone is a correction
    with pytest.raises(ConfigError, match="use_rollout_log_probs=false"):
        _config(pipeline__max_staleness=1, pipeline__rollout_rs_threshold=2.0, rollout__use_rollout_log_probs=True)
    with pytest.raises(ConfigError, match="asynchronous pipeline only"):
        _config(pipeline__rollout_rs_threshold=2.0)
    with pytest.raises(ConfigError, match="max_staleness must be >= 0"):
        PipelineConfig(max_staleness=-1)


def _bridge_round_trips(cases: list[tuple[int, str | None]]) -> list[float]:
    import torch
    import torch.distributed as dist

    from tinyzero.distributed import init_distributed
    from tinyzero.rollout.weight_bridge import bridge_group, open_bridge, receive_params, send_params

    init_distributed(60)
    g = torch.Generator().manual_seed(0)
    tensors = [("a.weight", torch.randn(3, 5, generator=g)), ("b.bias", torch.randn(7, generator=g).bfloat16()),
               ("c.steps", torch.arange(5, dtype=torch.int64)), ("d.flag", torch.tensor([True, False, True])),
               ("e.half", torch.randn(2, 3, generator=g).half()), ("f.big", torch.randn(40, 9, generator=g))]
    open_bridge([0, 1])
    group = bridge_group([0, 1])
    out = []
    for bucket_bytes, cast in cases:
        dtype = getattr(torch, cast) if cast else None
        if dist.get_rank() == 0:
            out.append(send_params(iter(tensors), group, src=0, send=True, bucket_bytes=bucket_bytes, dtype=dtype))
            continue
        # what the engine should hold: floating-point tensors in its dtype, the others as they are
        wants = [(n, t.to(dtype) if dtype is not None and t.is_floating_point() else t) for n, t in tensors]
        got = [(name, t.clone()) for name, t in receive_params(group, src=0, device=torch.device("cpu"))]
        assert [n for n, _ in got] == [n for n, _ in wants]
        for (name, want), (_, have) in zip(wants, got):
            assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want), name
        out.append(float(sum(float(t.double().sum()) for _, t in wants)))
    return out


@pytest.mark.slow
def test_weight_bridge_moves_every_dtype_bit_for_bit():
    # A bucket per tensor, a few tensors per bucket (unaligned sizes), one bucket for all; then cast to the
    # engine's bf16 (floating-point tensors only) on the way.
    cases = [(1, None), (64, None), (1 << 20, None), (64, "bfloat16")]
    sent, reference = run_distributed(_bridge_round_trips, 2, cases, timeout=120, env={"CUDA_VISIBLE_DEVICES": ""})
    assert sent == pytest.approx(reference, rel=1e-12)


def test_weight_checksum_sums_in_float64_without_a_whole_copy(monkeypatch):
    """tensor_sum accumulates float64 partial sums a chunk at a time: the same value as a float64 copy's sum."""
    import torch

    from tinyzero.rollout import weight_bridge

    monkeypatch.setattr(weight_bridge, "_SUM_CHUNK", 7)  # ragged chunks
    g = torch.Generator().manual_seed(1)
    for t in (torch.randn(5, 9, generator=g), torch.randn(13, generator=g).bfloat16(), torch.arange(10)):
        assert weight_bridge.tensor_sum(t) == pytest.approx(float(t.double().sum()), rel=1e-12, abs=1e-12)


def test_sequence_masked_importance_sampling_against_a_loop():
    import torch

    from tinyzero.algorithms.rollout_correction import seq_mis_keep

    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 9, generator=g) * 0.5
    rollout = old + torch.randn(64, 9, generator=g) * 0.8
    mask = (torch.rand(64, 9, generator=g) > 0.3).long()
    mask[0] = 0  # no valid token: kept
    keep = seq_mis_keep(old, rollout, mask, threshold=1.5)
    for i in range(64):
        diffs = [float(old[i, t]) - float(rollout[i, t]) for t in range(9) if mask[i, t]]
        ratio = math.exp(sum(diffs) / len(diffs)) if diffs else 1.0
        assert bool(keep[i]) == (1 / 1.5 <= ratio <= 1.5), (i, ratio)
    assert 0 < int(keep.sum()) < 64
    with pytest.raises(ValueError, match="must be > 1"):
        seq_mis_keep(old, rollout, mask, threshold=1.0)
