"""One-line Python functions from a short spec, scored only by running them (data_source "code_exec").

    python -m tinyzero.data.preprocess.code_tasks --out data/code_tasks [--seed 0]

A prompt names an operation and a constant ("mul 3:"); the answer is a program defining f
("def f(x):return x*3"), scored by tinyzero.rewards.code_exec: veRL's call-based ground truth
({"fn_name": "f", "inputs": [[x], ...], "outputs": [...]}) as a JSON string, the fraction of the
test calls that return the right value. The SFT rows teach the format only: their constants are
near misses (k + 1 or k + 2), so a warmed-up model copies the constant from the spec and writes
programs that run but are wrong.

In-process use (the code learning check):
    from tinyzero.data.preprocess.code_tasks import build_data
    build_data("runs/code_exec/data", seed=0)    # train.parquet, test.parquet, sft.parquet
"""

from __future__ import annotations

import argparse
import json
import os
import random

from tinyzero.data.preprocess.common import make_row, write_parquet, write_splits

__all__ = ["OPS", "TEST_INPUTS", "problems", "program", "ground_truth", "build_data"]

OPS = {"add": "+", "sub": "-", "mul": "*"}
"""Spec word -> Python operator."""
CONSTANTS = range(1, 10)
TEST_INPUTS = (23, 31, 47, -25, -52)
"""The calls every program is tested on. Every |x| is larger than the constants of the task and its
warm-up (at most 11), so no wrong program "x<op>c" passes a single call. With x = 0 every product
would pass, with x = 1 "x*4" would pass for "add 3": such partial scores pull the policy towards
the wrong operator."""
SFT_OFFSETS = (1, 2)
"""Near-miss offsets of the warm-up constants (k + 1 or k + 2: never the answer)."""


def problems() -> list[tuple[str, int]]:
    """Every (operation, constant) pair."""
    return [(op, k) for op in OPS for k in CONSTANTS]


def program(op: str, k: int) -> str:
    """The reference answer of a problem."""
    return f"def f(x):return x{OPS[op]}{k}"


def ground_truth(op: str, k: int) -> str:
    """veRL's call-based tests of a problem, as a JSON string."""
    apply = {"add": lambda x: x + k, "sub": lambda x: x - k, "mul": lambda x: x * k}[op]
    return json.dumps({"fn_name": "f", "inputs": [[x] for x in TEST_INPUTS],
                       "outputs": [apply(x) for x in TEST_INPUTS]})


def build_data(out_dir: str, seed: int = 0, train_repeats: int = 8, sft_repeats: int = 16) -> None:
    """train / test RL parquets (every problem; train repeated) and the format-only SFT parquet."""
    def rows(split: str, repeats: int) -> list[dict]:
        out = []
        for _ in range(repeats):
            for op, k in problems():
                out.append(make_row("code_exec", f"{op} {k}:", ground_truth(op, k), split, len(out),
                                    ability="code", op=op, k=k))
        return out

    write_splits(out_dir, rows("train", train_repeats), rows("test", 1))
    rng = random.Random(seed)
    sft = [{"prompt": [{"role": "user", "content": f"{op} {k}:"}], "response": program(op, k + rng.choice(SFT_OFFSETS))}
           for _ in range(sft_repeats) for op, k in problems()]
    write_parquet(sft, os.path.join(out_dir, "sft.parquet"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", "--local_dir", dest="out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    build_data(a.out, seed=a.seed)


if __name__ == "__main__":
    main()
