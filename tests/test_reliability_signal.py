"""SIGTERM mid-run on 2 CPU ranks: the job saves at the end of the step, exits non-zero, and the resume
loses no step and reproduces the uninterrupted run's metrics exactly.

The signal goes to one rank only (the other never sees it), so the ranks must agree through the
collective at the step's end; the resumed metrics are compared bit for bit with an uninterrupted
run of the same command (timings excluded).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from bench.chaos import ENV, ROOT, comparable, train_cmd, worker_pids
from tinyzero.trainer.loggers import read_metrics

STEPS = 5
GRACE_S = 120  # generous: the bound is what is tested, and CI machines may be loaded
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    from tinyzero.demo import build_data

    root = tmp_path_factory.mktemp("signal_data")
    build_data(str(root))
    return str(root)


def test_sigterm_saves_then_resume_matches_uninterrupted(demo_data, tiny_model_dir, tmp_path):
    full = subprocess.run(train_cmd(demo_data, tiny_model_dir, str(tmp_path / "full"), STEPS), env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr[-4000:]
    cmd = train_cmd(demo_data, tiny_model_dir, str(tmp_path / "cut"), STEPS, f"--reliability.signal_grace_s={GRACE_S}")
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    pids = worker_pids(proc.pid)
    assert 1 in pids, "rank 1 not found"
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGTERM)  # one rank only: the ranks must agree by themselves
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, "a run stopped by SIGTERM must not exit 0\n" + err[-4000:]
    assert err.count("stopped by SIGTERM after step") == 1, err[-4000:]
    assert elapsed < GRACE_S, f"took {elapsed:.1f} s from SIGTERM to exit (reliability.signal_grace_s={GRACE_S})"
    saved = sorted(os.listdir(tmp_path / "cut" / "checkpoints"))
    steps = [int(n.rsplit("_", 1)[1]) for n in saved if n.startswith("global_step_")]
    assert len(steps) == 1 and 2 <= steps[0] < STEPS, saved  # save_freq=-1: only the signal saved
    # The resume (same command) loses no step and reproduces the uninterrupted run bit for bit.
    resumed = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a, b = read_metrics(str(tmp_path / "full")), read_metrics(str(tmp_path / "cut"))
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
