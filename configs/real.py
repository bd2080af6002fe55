"""GRPO on a real pretrained model on 2 CPU ranks: SmolLM2-135M-Instruct learns to add numbers up to 20.

    python -m tinyzero.models.from_gguf --out runs/real/smollm2-135m-instruct     # once (fetches 93 MB)
    python -m tinyzero.configs.real --out runs/real/data                           # the task parquets
    torchrun --nproc_per_node 2 train.py --preset real_cpu

The task: "What is a + b?" for a, b in 1..20, in SmolLM2's ChatML with the assistant's turn begun
as "a + b = " (pre-rendered like TinyZero's prompts, so data.apply_chat_template is off). The reply
must begin with the sum followed by a space, a newline or the end of the turn ("68." does not
count); the arithmetic rule scores 1.0 for the sum, 0.1 for another integer, 0 otherwise. Sampled
at temperature 1 the model starts with about 30% of its replies right (two-digit operands 10..99:
about 5%); GRPO pulls it to answer the sum and stop.
"""

from __future__ import annotations

import argparse
import random

from tinyzero.configs.demo import demo_cpu

from tinyzero.config import Config

REAL_DIR = "runs/real"
MAX_OPERAND = 20
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def render_prompt(a: int, b: int) -> str:
    """SmolLM2's ChatML with its default system prompt, the assistant's turn begun with the equation."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n"
            f"<|im_start|>assistant\n{a} + {b} = ")


def task_rows(num_rows: int, seed: int, split: str, exclude: set | None = None) -> list[dict]:
    """Distinct problems a + b, a and b in 1..MAX_OPERAND (none of `exclude`), scored in the arithmetic
    plain format."""
    from tinyzero.data.preprocess.common import make_row

    rng, seen, rows = random.Random(seed), set(exclude or ()), []
    if num_rows + len(seen) > MAX_OPERAND**2:
        raise ValueError(f"only {MAX_OPERAND**2} distinct problems; ask for fewer than {num_rows} rows "
                         f"(plus {len(seen)} excluded)")
    while len(rows) < num_rows:
        a, b = rng.randint(1, MAX_OPERAND), rng.randint(1, MAX_OPERAND)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append(make_row("arithmetic", render_prompt(a, b), str(a + b), split, len(rows),
                             answer_format="plain", a=a, b=b, op="+"))
    return rows


def write_data(out_dir: str, train_size: int = 320, test_size: int = 32, seed: int = 0) -> tuple[str, str]:
    """out_dir/train.parquet and out_dir/test.parquet (disjoint problems); returns their paths."""
    from tinyzero.data.preprocess.common import write_splits

    train = task_rows(train_size, seed, "train")
    test = task_rows(test_size, seed + 1, "test", exclude={(r["extra_info"]["a"], r["extra_info"]["b"]) for r in train})
    return write_splits(out_dir, train, test)


def real_cpu() -> Config:
    """GRPO, SmolLM2-135M-Instruct fp32 on 2 CPU ranks: 8 prompts x 4 samples, 16 new tokens, 8 steps.
    Run it on 2 ranks (the rollout's tensor-parallel group spans both).

    The CPU demo's settings (native rollout, no KL, fp32, sdpa) with the real model and its task; one
    optimizer step per batch (strictly on-policy) at a fine-tuning learning rate."""
    cfg = demo_cpu()
    d = cfg.data
    d.train_files = [f"{REAL_DIR}/data/train.parquet"]
    d.val_files = [f"{REAL_DIR}/data/test.parquet"]
    d.train_batch_size = 8
    d.max_prompt_length = 64
    d.max_response_length = 16

    arr = cfg.actor_rollout_ref
    arr.model.path = f"{REAL_DIR}/smollm2-135m-instruct"
    arr.actor.optim.lr = 2e-5
    arr.actor.ppo_mini_batch_size = 8
    arr.rollout.n = 4
    arr.rollout.log_prob_micro_batch_size_per_gpu = 16
    # Exact, and what makes a real model's step cheap on CPU: each group's prompt is computed once in
    # training ([prompt, response_1 .. response_4] packed), and the layers keep less for backward.
    arr.model.use_shared_prefix = True
    arr.model.use_fused_layers = True
    # The rollout between updates: both ranks decode the batch together (each reads half of the MLP
    # and lm_head weights per token; tensor-parallel native decode), and the engine's weight copy and
    # cache are freed for the update (sleep level 2).
    arr.rollout.tensor_model_parallel_size = 2
    arr.rollout.sleep_level = 2

    t = cfg.trainer
    t.project_name = "tinyzero-real"
    t.experiment_name = "real-cpu-grpo-smollm2"
    t.default_local_dir = f"{REAL_DIR}/grpo"
    t.total_training_steps = 8
    t.test_freq = -1
    t.val_before_train = False
    # Each phase reuses the heap pages the previous one freed instead of faulting in fresh ones
    # (tinyzero.runtime.host_memory): about a quarter of an fp32 update's time on a VM.
    cfg.tuning.host_keep_freed_memory = True
    return cfg


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=f"{REAL_DIR}/data", help="output folder for train.parquet / test.parquet")
    p.add_argument("--train_size", type=int, default=320)
    p.add_argument("--test_size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    write_data(a.out, a.train_size, a.test_size, a.seed)


if __name__ == "__main__":
    main()
