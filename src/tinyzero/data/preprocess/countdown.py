"""Countdown tasks (TinyZero): reach a target with + - * / using each given number exactly once.

    python -m tinyzero.data.preprocess.countdown --out data/countdown \
        [--train_size 327680 --test_size 1024 --template_type base|qwen-instruct --seed 0]

Every task is solvable by construction: numbers are drawn, a random expression tree over all
of them is built with exact (fraction-free) arithmetic -- divisions only where they divide
evenly -- and its value becomes the target when it lies in [min_target, max_target]. The
reference solution is kept in extra_info["solution"]. Prompts use TinyZero's two templates
(pre-rendered text, so train with data.apply_chat_template=False).
"""

from __future__ import annotations

import argparse
import random

from tinyzero.data.preprocess.common import make_row, write_splits

__all__ = ["generate_rows", "generate_task", "make_prompt", "TEMPLATES"]

TEMPLATES = ("base", "qwen-instruct")
_INSTRUCTION = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> "
    "tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 "
    "</answer>."
)


def make_prompt(target: int, numbers: list[int], template_type: str = "base") -> str:
    """TinyZero's countdown prompt text for one task."""
    task = _INSTRUCTION.format(numbers=list(numbers), target=target)
    if template_type == "base":
        return (
            "A conversation between User and Assistant. The user asks a question, and the Assistant solves "
            "it. The assistant first thinks about the reasoning process in the mind and then provides the "
            f"user with the answer.\nUser: {task}\nAssistant: Let me solve this step by step.\n<think>"
        )
    if template_type == "qwen-instruct":
        return (
            "<|im_start|>system\nYou are a helpful assistant. You first thinks about the reasoning process "
            "in the mind and then provides the user with the answer.<|im_end|>\n<|im_start|>user\n "
            f"{task}<|im_end|>\n<|im_start|>assistant\nLet me solve this step by step.\n<think>"
        )
    raise ValueError(f"template_type must be one of {TEMPLATES}, got {template_type!r}")


def _combine(rng: random.Random, a: tuple[int, str], b: tuple[int, str]) -> tuple[int, str] | None:
    op = rng.choice("+-*/")
    (va, ea), (vb, eb) = a, b
    if op == "+":
        value = va + vb
    elif op == "-":
        value = va - vb
    elif op == "*":
        value = va * vb
    else:
        if vb == 0 or va % vb:
            return None
        value = va // vb
    return value, f"({ea} {op} {eb})"


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[int, str] | None:
    items = [(n, str(n)) for n in numbers]
    rng.shuffle(items)
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        combined = _combine(rng, items[i], items[j])
        if combined is None:
            return None
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [combined]
    value, expr = items[0]
    return value, expr[1:-1] if expr.startswith("(") else expr


def generate_task(rng: random.Random, min_count: int = 3, max_count: int = 4, min_number: int = 1,
                  max_number: int = 99, min_target: int = 1, max_target: int = 100,
                  tries_per_draw: int = 50) -> tuple[int, list[int], str]:
    """(target, numbers, solution) of one solvable task."""
    for _ in range(10_000):
        count = rng.randint(min_count, max_count)
        numbers = [rng.randint(min_number, max_number) for _ in range(count)]
        for _ in range(tries_per_draw):
            result = _random_expression(rng, numbers)
            if result is not None and min_target <= result[0] <= max_target:
                return result[0], numbers, result[1]
    raise ValueError(f"no task reaches a target in [{min_target}, {max_target}] with {min_count}-{max_count} "
                     f"numbers in [{min_number}, {max_number}]; widen the ranges")


def generate_rows(num_rows: int, seed: int = 0, template_type: str = "base", split: str = "train",
                  start_index: int = 0, **task_kwargs) -> list[dict]:
    """num_rows countdown rows (data_source "countdown"), deterministic in seed."""
    if template_type not in TEMPLATES:
        raise ValueError(f"template_type must be one of {TEMPLATES}, got {template_type!r}")
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        target, numbers, solution = generate_task(rng, **task_kwargs)
        rows.append(make_row("countdown", make_prompt(target, numbers, template_type),
                             {"target": target, "numbers": numbers}, split, start_index + i,
                             solution=solution))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", "--local_dir", dest="out", required=True, help="output folder")
    p.add_argument("--train_size", type=int, default=327680)
    p.add_argument("--test_size", type=int, default=1024)
    p.add_argument("--template_type", choices=TEMPLATES, default="base")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min_count", type=int, default=3, help="fewest numbers per task")
    p.add_argument("--max_count", type=int, default=4, help="most numbers per task")
    p.add_argument("--min_number", type=int, default=1)
    p.add_argument("--max_number", type=int, default=99)
    p.add_argument("--min_target", type=int, default=1)
    p.add_argument("--max_target", type=int, default=100)
    a = p.parse_args(argv)
    if not 2 <= a.min_count <= a.max_count:
        p.error("need 2 <= --min_count <= --max_count")
    if a.min_number > a.max_number or a.min_target > a.max_target:
        p.error("need --min_number <= --max_number and --min_target <= --max_target")
    kw = dict(min_count=a.min_count, max_count=a.max_count, min_number=a.min_number, max_number=a.max_number,
              min_target=a.min_target, max_target=a.max_target)
    train = generate_rows(a.train_size, seed=a.seed, template_type=a.template_type, split="train", **kw)
    test = generate_rows(a.test_size, seed=a.seed + 1_000_003, template_type=a.template_type, split="test", **kw)
    write_splits(a.out, train, test)


if __name__ == "__main__":
    main()
