"""One GRPO step of the tiny model on 2 CPU ranks: wall time per step, its phases, generated tokens/s.

    python bench/train_step.py                     # 8 prompts x 4 samples, 64 new tokens, 2 ranks
    python bench/train_step.py --steps 5 --nproc 2 --response-length 64
    python bench/train_step.py --packing shared_prefix   # A/B: none | remove_padding | shared_prefix

The run is what users launch (`torchrun --nproc_per_node 2 train.py --preset demo_cpu ...`),
with the offline tiny model at its random initialisation (it rarely emits eos, so responses
run to the full 64 tokens) and the demo's "a+b=" prompts. The first step pays one-time costs
(allocator, first weight sync), so figures are medians over the later steps, read from the
run's metrics.jsonl (timing_s/<phase>, perf/gen_tokens_per_s). Where TRL is installed its
GRPOTrainer could be timed on the same work; here it is reported as trl_available.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("gen", "weight_sync", "old_log_prob", "ref", "reward", "adv", "update_actor")
PACKING_FLAGS = {"none": (), "remove_padding": ("--actor_rollout_ref.model.use_remove_padding=true",),
                 "shared_prefix": ("--actor_rollout_ref.model.use_shared_prefix=true",)}


def run_steps(work: str, nproc: int, steps: int, prompts: int, samples: int, response_length: int,
              packing: str = "none") -> list[dict]:
    """Launch train.py for `steps` GRPO steps; return the metrics rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    run_dir = os.path.join(work, "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "train.py"), "--preset", "demo_cpu",
           f"--data.train_files={work}/data/train.parquet", "--data.val_files",
           f"--actor_rollout_ref.model.path={work}/tiny_model", f"--trainer.default_local_dir={run_dir}",
           f"--data.train_batch_size={prompts}", f"--data.max_response_length={response_length}",
           f"--actor_rollout_ref.rollout.n={samples}", f"--actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
           # A tiny learning rate keeps the work of every step the same (responses stay ~full length).
           "--actor_rollout_ref.actor.optim.lr=1e-7",
           f"--trainer.total_training_steps={steps}", "--trainer.val_before_train=false",
           "--trainer.save_freq=-1", "--trainer.export_hf=false", "--trainer.plot=false",
           "--trainer.progress_bar=false", "--trainer.resume_mode=disable", "--trainer.log_samples=0",
           *PACKING_FLAGS[packing]]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"train.py failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    from tinyzero.trainer.loggers import read_metrics

    return read_metrics(run_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="steps run; the first is left out of the medians")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--packing", choices=sorted(PACKING_FLAGS), default="none",
                   help="packed training passes (model.use_remove_padding / model.use_shared_prefix)")
    args = p.parse_args(argv)
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is a warm-up)")

    from tinyzero.demo import build_data
    from tinyzero.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as work:
        build_tiny_model(os.path.join(work, "tiny_model"), seed=0)
        build_data(os.path.join(work, "data"))
        start = time.monotonic()
        rows = run_steps(work, args.nproc, args.steps, args.prompts, args.samples, args.response_length,
                         args.packing)
        wall = time.monotonic() - start
    timed = rows[1:]

    def med(key: str) -> float | None:
        values = [r[key] for r in timed if key in r]
        return round(statistics.median(values), 4) if values else None

    phases = {name: med(f"timing_s/{name}") for name in PHASES if med(f"timing_s/{name}") is not None}
    for r in rows:
        print(f"step {r['step']}: step {r['timing_s/step']:.3f}s  " + "  ".join(
            f"{k} {r.get(f'timing_s/{k}', 0.0):.3f}" for k in PHASES) +
            f"  response_len {r['response_length/mean']:.1f}", flush=True)
    result = {
        "bench": "train_step", "algorithm": "grpo", "model": "tiny (offline, random init)", "device": "cpu",
        "nproc": args.nproc, "packing": args.packing, "prompts": args.prompts, "samples_per_prompt": args.samples,
        "max_new_tokens": args.response_length, "steps_timed": len(timed),
        "step_s": med("timing_s/step"), "phases_s": phases,
        "gen_tokens_per_s": med("perf/gen_tokens_per_s"),
        "response_length_mean": med("response_length/mean"),
        "throughput_tokens_per_s_per_rank": med("perf/throughput"),
        "launch_to_exit_s": round(wall, 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "trl_available": importlib.util.find_spec("trl") is not None,
        "trl_step_s": None,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
