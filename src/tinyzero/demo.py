"""The CPU demo: a tiny model learns single-digit addition with GRPO on 2 CPU ranks, in a few minutes.

    python -m tinyzero.demo [--task add] [--out runs/demo] [--nproc 2] [--steps N] [--seed S]
    python -m tinyzero.demo --task tools      # multi-turn: a calculator tool (see tinyzero.demo_tools)

Stages (everything offline, written under --out):
  1. build the tiny Qwen2-style model (random weights, byte-level tokenizer) and the task data:
     prompts "a+b=" with a, b in 0..4, the answer is the sum ("7"), scored 1.0 / 0.1 (a number, but
     wrong) / 0 by the arithmetic rule;
  2. SFT warm-up (`train.py sft --preset demo_cpu_sft`): teaches the *format* only -- its targets
     are near misses (the sum + 1 or + 2), so the model learns to answer with a number and stop,
     and starts with (almost) no right answers;
  3. GRPO (`train.py --preset demo_cpu`): 8 samples per prompt, group-normalised advantages;
     the reward alone has to teach the right answers;
  4. a table of validation score / accuracy before vs after, and the curves (RUN/grpo/curves.png).

To run the real thing instead, see train.py's docstring: a real model path
(--actor_rollout_ref.model.path), real data (python -m tinyzero.data.preprocess.countdown), a preset
(countdown_qwen2_5_3b_grpo) and GPUs (torchrun --nproc_per_node 8, rollout.name=vllm).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

MAX_OPERAND = 4
# Warm-up targets are near misses, always a little too high (the sum never appears): the model learns
# the format and answers wrong at first (accuracy ~0); the reward then has to pull its answers down.
SFT_OFFSETS = (1, 2)


def build_data(out_dir: str, seed: int = 0) -> None:
    """train/test RL parquets (every "a+b=" problem) and the format-only SFT parquet."""
    from tinyzero.data.preprocess.common import make_row, write_parquet

    problems = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    os.makedirs(out_dir, exist_ok=True)

    def rows(split: str, repeats: int) -> list[dict]:
        out = []
        for _ in range(repeats):
            for a, b in problems:
                out.append(make_row("arithmetic", f"{a}+{b}=", str(a + b), split, len(out),
                                    answer_format="plain", a=a, b=b, op="+"))
        return out

    write_parquet(rows("train", 8), os.path.join(out_dir, "train.parquet"))
    write_parquet(rows("test", 1), os.path.join(out_dir, "test.parquet"))
    rng = random.Random(seed)
    sft = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "response": str(rng.choice([a + b + d for d in SFT_OFFSETS if a + b + d >= 0]))}
           for _ in range(16) for a, b in problems]
    write_parquet(sft, os.path.join(out_dir, "sft.parquet"))


def torchrun(nproc: int, args: list[str], env: dict) -> None:
    """Run train.py under torchrun on `nproc` local CPU ranks; raise if it fails."""
    train_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "train.py")
    train_py = os.path.normpath(train_py)
    if not os.path.exists(train_py):
        raise FileNotFoundError(f"train.py not found at {train_py}; run the demo from a source checkout")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", train_py,
           *args]
    print("$ " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, env=env)


def summary(run_dir: str) -> tuple[dict, dict]:
    """(first validation row, last validation row) of a run's metrics.jsonl."""
    from tinyzero.trainer.loggers import read_metrics

    rows = [r for r in read_metrics(run_dir) if any(k.startswith("val-core/") for k in r)]
    return rows[0], rows[-1]


def print_table(before: dict, after: dict) -> None:
    keys = sorted(k for k in after if (k.startswith("val-core/") and "/std" not in k)
                  or k in ("val-aux/agent/tool_calls/mean", "val-aux/agent/turns/mean"))
    width = max(len(k) for k in keys)
    print(f"\n{'metric':<{width}}  before (step {before['step']})  after (step {after['step']})")
    for k in keys:
        print(f"{k:<{width}}  {before.get(k, float('nan')):>17.3f}  {after[k]:>16.3f}")


def validate_without_tools(nproc: int, out: str, common: list[str], env: dict) -> float:
    """The tools demo: validation accuracy of the trained policy (OUT/grpo/hf_model) with the calculator
    disabled; printed."""
    from tinyzero import demo_tools
    from tinyzero.trainer.val_metrics import core_mean

    torchrun(nproc, ["--preset", "demo_cpu_tools", *common, f"--actor_rollout_ref.model.path={out}/grpo/hf_model",
                     f"--trainer.default_local_dir={out}/no_tools", "--trainer.val_only=true",
                     "--actor_rollout_ref.rollout.multi_turn.enable=false"], env)
    without = core_mean(summary(os.path.join(out, "no_tools"))[-1], demo_tools.DATA_SOURCE)
    with_tools = core_mean(summary(os.path.join(out, "grpo"))[-1], demo_tools.DATA_SOURCE)
    print(f"\nvalidation accuracy of the trained policy: {with_tools:.3f} with the calculator, "
          f"{without:.3f} without it")
    return without


def tasks() -> dict[str, tuple]:
    """--task name -> (build_data, tiny-model arguments, SFT preset, GRPO preset, default --out)."""
    from tinyzero import demo_tools

    return {"add": (build_data, {}, "demo_cpu_sft", "demo_cpu", "runs/demo"),
            "tools": (demo_tools.build_data, demo_tools.MODEL, "demo_cpu_tools_sft", "demo_cpu_tools",
                      "runs/demo_tools")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="add", choices=("add", "tools"),
                   help="add: single-digit addition; tools: 2x3-digit products with a calculator tool")
    p.add_argument("--out", default=None, help="folder for the model, data and runs (default: runs/demo, "
                   "runs/demo_tools for --task tools)")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model init, the data and the runs")
    args = p.parse_args(argv)
    start = time.monotonic()
    make_data, model_args, sft_preset, grpo_preset, default_out = tasks()[args.task]
    out = args.out or default_out
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}

    from tinyzero.models.tiny import build_tiny_model

    build_tiny_model(os.path.join(out, "tiny_model"), seed=args.seed, **model_args)
    make_data(os.path.join(out, "data"), seed=args.seed)
    seeds = [f"--trainer.seed={args.seed + 1}", f"--data.seed={args.seed + 1}",
             f"--actor_rollout_ref.rollout.seed={args.seed}"]
    common = [f"--data.train_files={out}/data/train.parquet", f"--data.val_files={out}/data/test.parquet",
              "--trainer.resume_mode=disable", *seeds]
    torchrun(args.nproc, ["sft", "--preset", sft_preset, f"--data.train_files={out}/data/sft.parquet",
                          f"--actor_rollout_ref.model.path={out}/tiny_model", f"--trainer.default_local_dir={out}/sft",
                          "--trainer.resume_mode=disable", *seeds], env)
    grpo = ["--preset", grpo_preset, *common, f"--actor_rollout_ref.model.path={out}/sft/hf_model",
            f"--trainer.default_local_dir={out}/grpo"]
    if args.steps:
        grpo.append(f"--trainer.total_training_steps={args.steps}")
    torchrun(args.nproc, grpo, env)
    before, after = summary(os.path.join(out, "grpo"))
    print_table(before, after)
    if args.task == "tools":
        validate_without_tools(args.nproc, out, common, env)
    curves = os.path.join(out, "grpo", "curves.png")
    curves = curves if os.path.exists(curves) else "not drawn (pip install matplotlib)"
    print(f"\ncurves: {curves}   metrics: {out}/grpo/metrics.jsonl   samples: {out}/grpo/samples.jsonl")
    print(f"total time: {time.monotonic() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
