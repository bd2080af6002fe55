"""Arithmetic tasks: TinyZero's "arithmetic" / "multiply" prompts, and a plain short form for the CPU demo.

    python -m tinyzero.data.preprocess.arithmetic --out data/arith [--digits 3 --ops '*' --style tagged]
    python -m tinyzero.data.preprocess.arithmetic --out data/demo --digits 1 --ops + --style plain

Styles (both data_source "arithmetic" unless overridden, scored by tinyzero.rewards.arithmetic):
  tagged  TinyZero's conversation prompt; the answer goes in <answer> </answer> tags.
  plain   a bare prompt such as "12+7=" whose response is the number ("19"); for tiny models.
          Rows carry extra_info["answer_format"] = "plain" so the scorer reads a bare integer.
Operands have up to `digits` digits (tagged mode mixes in shorter ones as TinyZero did);
subtraction keeps the larger operand first, so results are never negative.

In-process use (the CPU demo):
    from tinyzero.data.preprocess.arithmetic import generate_rows, write_parquet
    rows = generate_rows(512, seed=0, digits=1, ops="+", style="plain")
    write_parquet(rows, "data/demo/train.parquet")
"""

from __future__ import annotations

import argparse
import random

from tinyzero.data.preprocess.common import make_row, write_parquet, write_splits

__all__ = ["generate_rows", "generate_splits", "make_prompt", "write_parquet", "STYLES", "OPS"]

STYLES = ("tagged", "plain")
OPS = "+-*"
_TAGGED_PREFIX = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the "
    "answer. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> "
    "tags, respectively, i.e., <think> reasoning process here </think> <answer> RESULT_NUMBER </answer>. "
)


def make_prompt(a: int, b: int, op: str, style: str = "tagged") -> str:
    """The prompt text of a op b in the given style."""
    if style == "plain":
        return f"{a}{op}{b}="
    if style == "tagged":
        return (f"{_TAGGED_PREFIX}\nUser: Give me the answer of the following equation: {a} {op} {b}.\n"
                "Assistant: Let me solve this step by step.\n<think>")
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def _operand(rng: random.Random, digits: int, mixed: bool) -> int:
    d = digits
    if mixed and digits > 1 and rng.randint(1, 3) == 1:
        d = digits - 1  # TinyZero: one operand in three is a digit shorter
    return rng.randint(0, 10**d - 1)


def _problem(rng: random.Random, digits: int, ops: str, mixed: bool) -> tuple[int, int, str]:
    a, b = _operand(rng, digits, mixed), _operand(rng, digits, mixed)
    op = rng.choice(ops)
    if op == "-" and a < b:
        a, b = b, a
    return a, b, op


def _check(digits: int, ops: str, style: str) -> None:
    if not 1 <= digits <= 18:
        raise ValueError(f"digits must be in 1..18, got {digits}")
    if not ops or any(o not in OPS for o in ops):
        raise ValueError(f"ops must be a non-empty string of characters from {OPS!r}, got {ops!r}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def generate_rows(num_rows: int, seed: int = 0, digits: int = 3, ops: str = "*", style: str = "tagged",
                  split: str = "train", start_index: int = 0, data_source: str = "arithmetic",
                  unique: bool = False, exclude: set | None = None) -> list[dict]:
    """num_rows arithmetic rows, deterministic in seed.

    unique: no problem (a, op, b) repeats; exclude: problems that must not appear (e.g. the
    training set's, when building a test split). Both raise ValueError if the problem space
    is too small.
    """
    _check(digits, ops, style)
    rng = random.Random(seed)
    seen: set = set(exclude or ())
    space = (10**digits) ** 2 * len(set(ops))
    if (unique or exclude) and num_rows + len(seen) > space // 2:
        raise ValueError(f"only {space} distinct problems with digits={digits}, ops={ops!r}; cannot draw "
                         f"{num_rows} distinct ones (plus {len(seen)} excluded)")
    rows = []
    while len(rows) < num_rows:
        a, b, op = _problem(rng, digits, ops, mixed=style == "tagged")
        if unique or exclude:
            if (a, op, b) in seen:
                continue
            seen.add((a, op, b))
        result = a + b if op == "+" else a - b if op == "-" else a * b
        extra = {"answer_format": style, "a": a, "b": b, "op": op}
        rows.append(make_row(data_source, make_prompt(a, b, op, style), str(result), split,
                             start_index + len(rows), **extra))
    return rows


def generate_splits(train_size: int, test_size: int, seed: int = 0, digits: int = 3, ops: str = "*",
                    style: str = "tagged", data_source: str = "arithmetic") -> tuple[list[dict], list[dict]]:
    """(train, test) rows; the test problems avoid the training ones when the problem space allows."""
    _check(digits, ops, style)
    space = (10**digits) ** 2 * len(set(ops))
    disjoint = train_size + test_size <= space // 2
    kw = dict(digits=digits, ops=ops, style=style, data_source=data_source)
    train = generate_rows(train_size, seed=seed, split="train", unique=disjoint, **kw)
    if not disjoint:
        return train, generate_rows(test_size, seed=seed + 1_000_003, split="test", **kw)
    taken = {(r["extra_info"]["a"], r["extra_info"]["op"], r["extra_info"]["b"]) for r in train}
    test = generate_rows(test_size, seed=seed + 1_000_003, split="test", exclude=taken, **kw)
    return train, test


def main(argv: list[str] | None = None, default_ops: str = "*", default_source: str = "arithmetic") -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", "--local_dir", dest="out", required=True, help="output folder")
    p.add_argument("--train_size", type=int, default=32768)
    p.add_argument("--test_size", type=int, default=4096)
    p.add_argument("--digits", type=int, default=3, help="most digits per operand")
    p.add_argument("--ops", default=default_ops, help=f"operators to draw from, a string over {OPS!r}")
    p.add_argument("--style", choices=STYLES, default="tagged")
    p.add_argument("--data_source", default=default_source)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        train, test = generate_splits(a.train_size, a.test_size, seed=a.seed, digits=a.digits, ops=a.ops,
                                      style=a.style, data_source=a.data_source)
    except ValueError as e:
        p.error(str(e))
    write_splits(a.out, train, test)


if __name__ == "__main__":
    main()
