"""Shared pieces of the preprocessors: building rows and writing the two split files."""

from __future__ import annotations

import os

from tinyzero.data.schema import validate_rl_row, write_parquet

__all__ = ["make_row", "write_parquet", "write_splits"]


def make_row(data_source: str, content: str, ground_truth, split: str, index: int, ability: str = "math",
             **extra) -> dict:
    """One RL row in the five-field format, with a single user message."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def write_splits(out_dir: str, train_rows: list[dict], test_rows: list[dict]) -> tuple[str, str]:
    """Validate and write out_dir/train.parquet and out_dir/test.parquet; print the row counts."""
    out_dir = os.path.expanduser(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, rows in (("train", train_rows), ("test", test_rows)):
        for i, row in enumerate(rows):
            problem = validate_rl_row(row)
            if problem is not None:
                raise ValueError(f"{name} row {i}: {problem}")
        path = os.path.join(out_dir, f"{name}.parquet")
        write_parquet(rows, path)
        paths.append(path)
        print(f"wrote {len(rows)} rows to {path}", flush=True)
    return paths[0], paths[1]
