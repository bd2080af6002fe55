"""Asynchronous RL vs the same pools taking turns: 1 rollout rank + 1 trainer rank, equal work.

    python bench/async.py                                  # offline tiny model, 2 CPU ranks
    python bench/async.py --steps 12 --response-length 32 --batch 16 --n 4
    python bench/async.py --model-path /path/to/SmolLM2-135M-Instruct --steps 6

Both runs are `train.py` (GRPO on the demo task) with the rollout engine on its own pool
(pipeline.rollout_pool_size=1): pipeline.max_staleness=1 (generation of batch k+1 overlaps the
update on batch k) against max_staleness=0 (the same pipeline serialized: generate, then train).
Same prompts, batch, samples, response length and steps; TIS (cap 2) in both. Figures over the
steps after the first `--skip` (start-up): steps per second of each, throughput_ratio = async /
sync, and the mean idle fractions of each pool (async/rollout_idle_frac, async/trainer_idle_frac:
the share of a step the pool waits). Only the update overlaps generation (see
tinyzero/trainer/async_pipeline.py), so the ratio is largest when the generation and update
times are equal. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(root: str, model: str, staleness: int, args) -> list[dict]:
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from tinyzero.trainer.loggers import read_metrics

    run = os.path.join(root, f"k{staleness}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), "--preset", "demo_cpu", f"--data.train_files={root}/data/train.parquet",
           f"--data.val_files={root}/data/test.parquet", f"--actor_rollout_ref.model.path={model}",
           f"--trainer.default_local_dir={run}", "--trainer.plot=false", "--trainer.logger=jsonl",
           "--trainer.val_before_train=false", "--trainer.test_freq=-1", "--trainer.save_freq=-1",
           "--trainer.export_hf=false", "--trainer.resume_mode=disable", f"--trainer.total_training_steps={args.steps}",
           "--pipeline.rollout_pool_size=1", f"--pipeline.max_staleness={staleness}",
           "--actor_rollout_ref.actor.tis_imp_ratio_cap=2.0", f"--data.train_batch_size={args.batch}",
           f"--actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}", f"--actor_rollout_ref.rollout.n={args.n}",
           f"--data.max_response_length={args.response_length}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"max_staleness={staleness} failed:\n{out.stderr[-4000:]}")
    return read_metrics(run)


def _summary(rows: list[dict], skip: int) -> dict:
    rows = rows[skip:]
    seconds = sum(r["timing_s/step"] for r in rows)
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {"steps_per_s": len(rows) / seconds, "step_s": seconds / len(rows),
            "rollout_idle_frac": mean("async/rollout_idle_frac"), "trainer_idle_frac": mean("async/trainer_idle_frac"),
            "gen_s": mean("timing_s/gen"), "update_actor_s": mean("timing_s/update_actor"),
            "staleness_mean": mean("async/staleness/mean")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="HF folder (default: the offline tiny model)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="steps left out of the figures (start-up)")
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--response-length", type=int, default=16, help="most tokens generated per sample")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args()
    if args.steps <= args.skip:
        raise SystemExit(f"--steps {args.steps} must exceed --skip {args.skip}")
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from tinyzero.demo import build_data
    from tinyzero.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as root:
        build_data(os.path.join(root, "data"))
        model = args.model_path
        if model is None:
            model = os.path.join(root, "model")
            build_tiny_model(model, seed=0)
        sync = _summary(_run(root, model, 0, args), args.skip)
        fast = _summary(_run(root, model, 1, args), args.skip)
    result = {"bench": "async", "ranks": {"rollout": 1, "trainer": 1}, "steps": args.steps, "skip": args.skip,
              "batch": args.batch, "n": args.n, "response_length": args.response_length,
              "model": args.model_path or "tiny", "sync_k0": sync, "async_k1": fast,
              "throughput_ratio": fast["steps_per_s"] / sync["steps_per_s"]}
    print(f"K=1 {fast['steps_per_s']:.3f} steps/s vs K=0 {sync['steps_per_s']:.3f} steps/s: "
          f"x{result['throughput_ratio']:.2f}; idle rollout {fast['rollout_idle_frac']:.2f} "
          f"(K=0 {sync['rollout_idle_frac']:.2f}), trainer {fast['trainer_idle_frac']:.2f} "
          f"(K=0 {sync['trainer_idle_frac']:.2f})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
