"""The hang watchdog ends a stuck 2-rank training job within reliability.hang_timeout_s + 30 s, naming the rank.

Each test launches `torchrun --nproc_per_node 2` on this file, which installs a fault on rank 1
(test code only, by patching a function before train.py runs) and then runs train.py exactly as a
user would (demo preset, tiny model, one GRPO step):

- sigstop: rank 1 stops itself (SIGSTOP) in the middle of the step, at its first actor update;
- update: rank 1 sleeps inside update_policy (its first gradient accumulation);
- generate: rank 1 sleeps inside generation, after its third decoded token.

Run a job by hand: torchrun --nproc_per_node 2 tests/test_watchdog.py update -- <train.py flags>
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_S = 3.0


def _install_fault(mode: str) -> None:
    """Patch the fault into rank 1 (never imported by the package: this file is the job's main script)."""
    if os.environ.get("RANK") != "1":
        return
    if mode in ("sigstop", "update"):
        import tinyzero.workers.actor  # noqa: F401 - imports the name update_policy calls
        import tinyzero.workers.update as update

        original = update.accumulate_gradients

        def accumulate_gradients(*args, **kwargs):
            print(f"[test] fault at {time.time()}", flush=True)
            if mode == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(3600)
            return original(*args, **kwargs)

        for name, module in list(sys.modules.items()):
            if name.startswith("tinyzero.workers") and getattr(module, "accumulate_gradients", None) is original:
                module.accumulate_gradients = accumulate_gradients
    elif mode == "generate":
        import tinyzero.rollout.generate as generate

        original_sample = generate.sample_from_logits
        calls = []

        def sample_from_logits(*args, **kwargs):
            calls.append(1)
            if len(calls) == 4:
                print(f"[test] fault at {time.time()}", flush=True)
                time.sleep(3600)
            return original_sample(*args, **kwargs)

        generate.sample_from_logits = sample_from_logits


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    from tinyzero.demo import build_data

    root = tmp_path_factory.mktemp("watchdog")
    build_data(str(root / "data"))
    return root


def _launch(root, mode: str, model: str):
    from tests.dist_utils import free_port

    run_dir = root / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           __file__, mode, "--", "--preset", "demo_cpu", f"--data.train_files={root}/data/train.parquet",
           "--data.val_files", f"--actor_rollout_ref.model.path={model}", f"--trainer.default_local_dir={run_dir}",
           "--data.train_batch_size=8", "--actor_rollout_ref.rollout.n=2", "--actor_rollout_ref.actor.ppo_mini_batch_size=8",
           "--trainer.total_training_steps=1", "--trainer.val_before_train=false", "--trainer.plot=false",
           "--trainer.progress_bar=false", "--trainer.export_hf=false", f"--reliability.hang_timeout_s={HANG_S}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, time.time()


def _silent_s(verdict: str) -> float:
    """How long the named rank had been silent when the watchdog decided."""
    return float(re.search(r"(?:no progress for|no heartbeat for) ([0-9.]+) s", verdict).group(1))


@pytest.mark.slow
@pytest.mark.parametrize("mode,phase", [("sigstop", "update_actor"), ("update", "update_actor"),
                                        ("generate", "generate")])
@pytest.mark.slow
def test_stuck_rank_is_named_within_the_bound(demo_data, tiny_model_dir, mode, phase):
    code, out, ended_at = _launch(demo_data, mode, tiny_model_dir)
    assert code != 0, out[-4000:]
    verdict = out[out.index("[tinyzero] hang:"):] if "[tinyzero] hang:" in out else ""
    assert verdict, out[-4000:]
    assert "rank(s) 1\n" in verdict, verdict
    first = verdict.splitlines()[1]
    assert first.strip().startswith("rank 1 "), verdict
    if mode == "sigstop":
        assert "stopped responding" in first, verdict
        assert "last progress" in first and "main thread at" in first, verdict  # its last heartbeat
    else:
        assert "not waiting for other ranks" in first and f"last progress in step 1: {phase}" in first, verdict
        # The live stuck rank dumped its stack: the sleep is on it.
        assert "[tinyzero] rank 1: Python stacks" in out and "test_watchdog.py" in out, out[-6000:]
    assert "[tinyzero] rank 0: Python stacks" in out
    assert "rank 0: waits in a collective" in verdict, verdict
    # Detected once the bound passed (within two heartbeats of it); the job over within bound + 30 s of the fault.
    assert HANG_S <= _silent_s(verdict) <= HANG_S + 2.0, verdict
    fault_at = float(re.search(r"\[test\] fault at ([0-9.]+)", out).group(1))
    assert ended_at - fault_at < HANG_S + 30, f"the job ended {ended_at - fault_at:.1f} s after the fault"


def _status(beat: int, age: float, still: float, waiting: bool, phase: str = "update_actor") -> dict:
    return {"beat": beat, "age": age, "still": still, "phase": phase, "detail": "", "step": 3, "recent": [],
            "where": "x.py:1 in f", "waiting": waiting, "host": "h", "pid": 1, "done": False}


def test_the_rule_names_the_stuck_rank_not_its_waiting_or_busy_peers():
    from tinyzero.runtime.progress import _Watchdog

    wd = _Watchdog(bound_s=10.0, poll_s=1.0, store=None, rank=0, world=3)
    # Rank 2 has reported nothing for 12 s but its main thread runs Python code (busy), rank 1 is
    # within the bound, rank 0 waits in a collective: nobody is stuck.
    busy = {0: _status(1, 12, 12, True), 1: _status(1, 4, 4, False), 2: _status(1, 12, 0.5, False)}
    assert wd.decide(busy, now=0.0) is None
    # Rank 1 sits still past the bound outside a collective: it alone is named.
    stuck = {0: _status(2, 12, 12, True), 1: _status(2, 11, 11, False), 2: _status(2, 12, 12, True)}
    verdict = wd.decide(stuck, now=1.0)
    assert "on rank(s) 1\n" in verdict and "rank 1 made no progress for 11.0 s" in verdict, verdict
    # Every rank waits in a collective: the one that stopped progressing first is named.
    deadlock = {0: _status(3, 12, 12, True), 1: _status(3, 15, 15, True), 2: _status(3, 11, 11, True)}
    assert "on rank(s) 1\n" in wd.decide(deadlock, now=2.0)
    # Start-up is not watched for progress (model loading reports nothing).
    startup = {r: _status(4, 50, 50, False, phase="startup") for r in range(3)}
    assert wd.decide(startup, now=3.0) is None
    # Rank 2's heartbeat stops changing: frozen once the bound passes on this rank's clock.
    frozen = {0: _status(5, 1, 1, False), 1: _status(5, 1, 1, False), 2: _status(4, 50, 50, False, "startup")}
    assert wd.decide(frozen, now=8.0) is None
    verdict = wd.decide({**frozen, 0: _status(6, 1, 1, False), 1: _status(6, 1, 1, False)}, now=14.0)
    assert "on rank(s) 2\n" in verdict and "rank 2 stopped responding: no heartbeat for 11.0 s" in verdict, verdict


def test_a_rank_waiting_for_its_gpu_is_not_blamed_for_a_slow_peer():
    """On a GPU a rank that waits for a slow peer sits in a host sync in its own code (the collective returned
    at once; its stream holds the queued wait): it waits, it is not stuck. The slow peer, still running, is
    busy: no verdict. When every rank waits (one for its GPU), the one that stopped first is named."""
    from tinyzero.runtime.progress import _gpu_pending, _Watchdog

    wd = _Watchdog(bound_s=10.0, poll_s=1.0, store=None, rank=0, world=2)
    gpu_wait = {**_status(1, 12, 12, False), "gpu_wait": True, "where": "actor.py:90 in update"}
    slow_peer = _status(1, 12, 0.3, False)  # a long phase that reports nothing, its frames moving
    assert wd.decide({0: gpu_wait, 1: slow_peer}, now=0.0) is None
    # Without the GPU's queued work the same still main thread is stuck.
    verdict = wd.decide({0: {**gpu_wait, "gpu_wait": False}, 1: slow_peer}, now=1.0)
    assert "on rank(s) 0\n" in verdict and "not waiting for other ranks" in verdict, verdict
    # Both wait (rank 1 in a collective that rank 0's GPU never reaches): rank 1 stopped first.
    verdict = wd.decide({0: {**gpu_wait, "age": 11}, 1: _status(2, 14, 14, True)}, now=2.0)
    assert "on rank(s) 1\n" in verdict and "every rank waits" in verdict, verdict
    assert "rank 0: waits for its GPU" in verdict, verdict
    assert _gpu_pending(None) is False  # CPU ranks: nothing to query


if __name__ == "__main__":
    mode, sep, *flags = sys.argv[1:]
    _install_fault(mode)
    sys.path.insert(0, ROOT)
    sys.argv = [os.path.join(ROOT, "train.py"), *flags]
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")
