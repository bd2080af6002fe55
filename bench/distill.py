"""On-policy distillation against GRPO on a sparse reward: the code task of bench/code_exec.py, 2 CPU ranks.

    python bench/distill.py [--out runs/distill] [--seeds 1,2,3] [--teacher_seed 0] [--steps N]

Stages (offline, under --out): the tiny model, the code data and the format warm-up, as
bench/code_exec.py builds them; a teacher trained by GRPO (`--preset code_exec_cpu`, exported to
OUT/teacher/hf_model); then, for each seed, from the same warm-up model and for the same number of
steps, (a) GRPO on the execution reward and (b) distillation alone from the teacher
(`--distill.teacher_path OUT/teacher/hf_model --distill.reward_weight 0`: the teacher's per-token
reverse KL is the advantage, the execution reward is only logged). Both validate every
--test_freq steps (greedy, 27 problems). After the warm-up every program runs but is wrong, so a
GRPO group scores 0 until one sample finds the right constant; the teacher penalises the wrong
constant in every sample.

The last line printed is one JSON object: the teacher's score, and per run the validation curve
(step -> score), the first step reaching the teacher's score (null if none), wall time and s/step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `bench` as a package

from bench.code_exec import score_key  # noqa: E402


def curve(rows: list[dict], key: str) -> dict[int, float]:
    """step -> validation score, from the metrics rows that carry `key`."""
    return {int(r["step"]): r[key] for r in rows if key in r}


def first_step_reaching(scores: dict[int, float], target: float, tol: float = 1e-6) -> int | None:
    """The first step whose score is at least `target` (within `tol`, the scores being fractions of
    the 27 problems written as floats), or None."""
    return next((step for step in sorted(scores) if scores[step] >= target - tol), None)


def mean_step_s(rows: list[dict]) -> float:
    """Mean of the trainer's `timing_s/step` over the training steps."""
    times = [r["timing_s/step"] for r in rows if "timing_s/step" in r]
    return sum(times) / len(times) if times else float("nan")


def seed_args(seed: int) -> list[str]:
    """The seeds of one run, as bench/code_exec.py sets them for --seed."""
    return [f"--trainer.seed={seed + 1}", f"--data.seed={seed + 1}", f"--actor_rollout_ref.rollout.seed={seed}",
            "--trainer.resume_mode=disable"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/distill")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sft_steps", type=int, default=None, help="warm-up steps (default: the preset's)")
    p.add_argument("--teacher_steps", type=int, default=None, help="the teacher's GRPO steps (default: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="steps of each compared run (default: the preset's)")
    p.add_argument("--test_freq", type=int, default=5, help="validation every N steps in the compared runs")
    p.add_argument("--teacher_seed", type=int, default=0,
                   help="seed of the tiny model, the data, the warm-up and the teacher's GRPO run")
    p.add_argument("--seeds", default="1,2,3",
                   help="comma-separated seeds of the compared runs; one equal to --teacher_seed repeats the "
                        "teacher's own run as its GRPO run")
    args = p.parse_args(argv)
    from tinyzero.data.preprocess.code_tasks import build_data
    from tinyzero.demo import torchrun
    from tinyzero.models.tiny import build_tiny_model
    from tinyzero.trainer.loggers import read_metrics

    start = time.monotonic()
    out = args.out
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    build_tiny_model(os.path.join(out, "tiny_model"), seed=args.teacher_seed)
    build_data(os.path.join(out, "data"), seed=args.teacher_seed)
    sft = ["sft", "--preset", "code_exec_cpu_sft", f"--data.train_files={out}/data/sft.parquet",
           f"--actor_rollout_ref.model.path={out}/tiny_model", f"--trainer.default_local_dir={out}/sft",
           *seed_args(args.teacher_seed)]
    if args.sft_steps:
        sft.append(f"--trainer.total_training_steps={args.sft_steps}")
    torchrun(args.nproc, sft, env)

    grpo = ["--preset", "code_exec_cpu", f"--data.train_files={out}/data/train.parquet",
            f"--data.val_files={out}/data/test.parquet", f"--actor_rollout_ref.model.path={out}/sft/hf_model"]
    teacher = [*grpo, f"--trainer.default_local_dir={out}/teacher", "--trainer.export_hf=true",
               *seed_args(args.teacher_seed)]
    if args.teacher_steps:
        teacher.append(f"--trainer.total_training_steps={args.teacher_steps}")
    torchrun(args.nproc, teacher, env)
    teacher_rows = read_metrics(os.path.join(out, "teacher"))
    key = score_key(teacher_rows[-1])
    teacher_curve = curve(teacher_rows, key)
    teacher_score = teacher_curve[max(teacher_curve)]

    compared = [*grpo, f"--trainer.test_freq={args.test_freq}"]
    if args.steps:
        compared.append(f"--trainer.total_training_steps={args.steps}")
    kinds = {"grpo": [], "distill": [f"--distill.teacher_path={out}/teacher/hf_model", "--distill.reward_weight=0"]}
    runs = []
    for seed in seeds:
        for kind, extra in kinds.items():
            run_dir = f"{out}/{kind}_seed{seed}"
            t0 = time.monotonic()
            torchrun(args.nproc, [*compared, *extra, f"--trainer.default_local_dir={run_dir}", *seed_args(seed)], env)
            wall = time.monotonic() - t0
            rows = read_metrics(run_dir)
            scores = curve(rows, key)
            runs.append({"run": kind, "seed": seed, "curve": scores,
                         "first_step_reaching_teacher": first_step_reaching(scores, teacher_score),
                         "final": scores[max(scores)], "wall_s": round(wall, 1),
                         "s_per_step": round(mean_step_s(rows), 3)})
            print(json.dumps(runs[-1]), flush=True)

    print(f"\nteacher ({key}): {teacher_score:.3f}; validation score by step")
    steps = sorted({s for r in runs for s in r["curve"]})
    print(f"{'run':<8} {'seed':>4}  " + " ".join(f"{s:>5}" for s in steps))
    for r in runs:
        print(f"{r['run']:<8} {r['seed']:>4}  " + " ".join(f"{r['curve'].get(s, float('nan')):>5.3f}" for s in steps))
    result = {"bench": "distill", "metric": key, "teacher_seed": args.teacher_seed, "teacher_score": teacher_score,
              "teacher_curve": teacher_curve, "teacher_reaches_0.85": teacher_score >= 0.85, "runs": runs,
              "wall_s": round(time.monotonic() - start, 1)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
