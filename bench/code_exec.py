"""The code learning check: the tiny model, rewarded only by running its programs in the sandbox, on 2 CPU ranks.

    python bench/code_exec.py [--out runs/code_exec] [--nproc 2] [--sft_steps N] [--steps N] [--seed S]

Stages (offline, under --out): the tiny model; the data (tinyzero.data.preprocess.code_tasks:
"mul 3:" -> "def f(x):return x*3", call-based tests); the format warm-up (`train.py sft --preset
code_exec_cpu_sft`, near-miss constants); GRPO (`train.py --preset code_exec_cpu`), whose only
reward is the fraction of test calls the program passes in the sandbox. The last line printed is
one JSON object: the validation score before and after GRPO, the rise, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def score_key(row: dict) -> str:
    """The validation metric of the code_exec data source's mean score in a metrics row."""
    keys = sorted(k for k in row if k.startswith("val") and "code_exec" in k and ("score" in k or "reward" in k)
                  and "std" not in k and "acc" not in k)
    if not keys:
        raise KeyError(f"no code_exec validation score among {sorted(row)}")
    return keys[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/code_exec")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sft_steps", type=int, default=None, help="warm-up steps (default: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from tinyzero.data.preprocess.code_tasks import build_data
    from tinyzero.demo import summary, torchrun
    from tinyzero.models.tiny import build_tiny_model

    start = time.monotonic()
    out = args.out
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    build_tiny_model(os.path.join(out, "tiny_model"), seed=args.seed)
    build_data(os.path.join(out, "data"), seed=args.seed)
    seeds = [f"--trainer.seed={args.seed + 1}", f"--data.seed={args.seed + 1}",
             f"--actor_rollout_ref.rollout.seed={args.seed}", "--trainer.resume_mode=disable"]
    sft = ["sft", "--preset", "code_exec_cpu_sft", f"--data.train_files={out}/data/sft.parquet",
           f"--actor_rollout_ref.model.path={out}/tiny_model", f"--trainer.default_local_dir={out}/sft", *seeds]
    if args.sft_steps:
        sft.append(f"--trainer.total_training_steps={args.sft_steps}")
    torchrun(args.nproc, sft, env)
    grpo = ["--preset", "code_exec_cpu", f"--data.train_files={out}/data/train.parquet",
            f"--data.val_files={out}/data/test.parquet", f"--actor_rollout_ref.model.path={out}/sft/hf_model",
            f"--trainer.default_local_dir={out}/grpo", *seeds]
    if args.steps:
        grpo.append(f"--trainer.total_training_steps={args.steps}")
    torchrun(args.nproc, grpo, env)
    before, after = summary(os.path.join(out, "grpo"))
    key = score_key(after)
    result = {"bench": "code_exec", "metric": key, "score_before": before[key], "score_after": after[key],
              "rise": after[key] - before[key], "step_before": before["step"], "step_after": after["step"],
              "wall_s": round(time.monotonic() - start, 1)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
