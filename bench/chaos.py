"""Chaos run: kill -9 or SIGTERM a random rank at a random moment, resume, compare with an uninterrupted run.

    python bench/chaos.py                      # 3 kills + 3 SIGTERMs, 2 CPU ranks, tiny model, 6 steps
    python bench/chaos.py --n 10 --steps 8 --save_freq 2

Each fault run launches `torchrun --nproc_per_node 2 train.py` (demo preset, tiny random model),
waits a random time within the reference run's duration, sends SIGKILL (the rank dies with no
warning) or SIGTERM (the job should save at the end of the step and stop) to one random rank,
and measures the seconds until torchrun exits; a run still alive `--hang_s` after the fault
is a hang (killed). The same command then resumes it (resume_mode=auto) and its metrics.jsonl
is compared with the uninterrupted run's, bit for bit (timings excluded). The last line is one
JSON object: runs, exact, hangs, max_fault_to_exit_s, and per-kind counts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def train_cmd(data_dir: str, model_dir: str, run_dir: str, steps: int, *extra: str) -> list[str]:
    """torchrun on 2 CPU ranks of the demo preset with a local model (no validation, plots or export)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            os.path.join(ROOT, "train.py"), "--preset", "demo_cpu", f"--data.train_files={data_dir}/train.parquet",
            f"--data.val_files={data_dir}/test.parquet", f"--actor_rollout_ref.model.path={model_dir}",
            f"--trainer.default_local_dir={run_dir}", "--trainer.plot=false", "--trainer.val_before_train=false",
            "--trainer.export_hf=false", "--trainer.test_freq=1000", f"--trainer.total_training_steps={steps}",
            *extra]


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes a torchrun launcher started (read from /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            out[int(env[b"RANK"])] = int(name)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return out


def comparable(row: dict) -> dict:
    """A metrics row without the fields that differ between identical runs (timings, throughput)."""
    return {k: v for k, v in row.items() if not k.startswith(("timing", "perf/", "reward/parallel"))}


def read_rows(run_dir: str) -> list[dict]:
    from tinyzero.trainer.loggers import read_metrics

    return [comparable(r) for r in read_metrics(run_dir)]


def fault_run(cmd: list[str], sig: int, delay_s: float, hang_s: float, rng: random.Random) -> dict:
    """Launch, wait delay_s, send `sig` to one random rank; return what happened."""
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + delay_s
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    pids = worker_pids(proc.pid)
    info = {"signal": signal.Signals(sig).name, "delay_s": round(delay_s, 2), "rank": None, "fault_to_exit_s": None,
            "hang": False}
    if proc.poll() is None and pids:
        rank = rng.choice(sorted(pids))
        info["rank"] = rank
        t0 = time.monotonic()
        try:
            os.kill(pids[rank], sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=hang_s)
        except subprocess.TimeoutExpired:
            info["hang"] = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        info["fault_to_exit_s"] = round(time.monotonic() - t0, 2)
    else:  # the run ended (or had not started its workers) before the fault: nothing was interrupted
        proc.wait()
    info["returncode"] = proc.returncode
    info["stopped_by_signal_line"] = "stopped by SIGTERM" in (proc.stderr.read() if proc.stderr else "")
    proc.stderr.close()
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=3, help="kills and SIGTERMs each")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save_freq", type=int, default=2)
    p.add_argument("--hang_s", type=float, default=120.0, help="a run alive this long after its fault is a hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep runs here (default: a temporary folder, removed)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    work = args.workdir or tempfile.mkdtemp(prefix="tinyzero-chaos-")
    os.makedirs(work, exist_ok=True)
    from tinyzero.demo import build_data
    from tinyzero.models.tiny import build_tiny_model

    data, model = os.path.join(work, "data"), os.path.join(work, "model")
    build_data(data)
    build_tiny_model(model, seed=0)
    extra = (f"--trainer.save_freq={args.save_freq}",)
    t0 = time.monotonic()
    subprocess.run(train_cmd(data, model, os.path.join(work, "reference"), args.steps, *extra), env=ENV, cwd=ROOT,
                   check=True, capture_output=True)
    reference_s = time.monotonic() - t0
    reference = read_rows(os.path.join(work, "reference"))
    results = []
    kinds = [signal.SIGKILL] * args.n + [signal.SIGTERM] * args.n
    for i, sig in enumerate(kinds):
        run_dir = os.path.join(work, f"run{i}")
        cmd = train_cmd(data, model, run_dir, args.steps, *extra)
        info = fault_run(cmd, sig, rng.uniform(0.1, 0.9) * reference_s, args.hang_s, rng)
        resumed = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=args.hang_s * 5)
        info["resume_returncode"] = resumed.returncode
        info["exact"] = resumed.returncode == 0 and read_rows(run_dir) == reference
        results.append(info)
        print(json.dumps(info), flush=True)
    times = [r["fault_to_exit_s"] for r in results if r["fault_to_exit_s"] is not None]
    summary = {
        "runs": len(results), "exact": sum(r["exact"] for r in results), "hangs": sum(r["hang"] for r in results),
        "max_fault_to_exit_s": max(times) if times else None,
        "kills": args.n, "sigterms": args.n, "faults_delivered": len(times), "steps": args.steps,
        "reference_s": round(reference_s, 1),
    }
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
