"""GSM8K from a local copy (jsonl or parquet with `question` / `answer`, as openai/gsm8k ships it).

    python -m tinyzero.data.preprocess.gsm8k --input gsm8k/main/train-00000-of-00001.parquet \
        --test_input gsm8k/main/test-00000-of-00001.parquet --out data/gsm8k
    python -m tinyzero.data.preprocess.gsm8k --input gsm8k_dir --out data/gsm8k   # finds train*/test* files
    python -m tinyzero.data.preprocess.gsm8k --input all.jsonl --test_size 500 --out data/gsm8k

Nothing is downloaded. Each question gets the instruction
'Let's think step by step and output the final answer after "####".'; the ground truth is
the text after "####" in the answer, commas removed. data_source is "openai/gsm8k".
With a single input file and no --test_input, a seeded random --test_size rows are held out.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re

import pyarrow.parquet as pq

from tinyzero.data.preprocess.common import make_row, write_splits

__all__ = ["INSTRUCTION", "extract_ground_truth", "read_records", "convert_rows"]

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "openai/gsm8k"
_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_ground_truth(answer: str) -> str:
    """The number after "####" in a GSM8K answer, commas removed."""
    m = _ANSWER_RE.search(answer)
    if m is None:
        raise ValueError(f"no '#### <number>' in answer {answer[-200:]!r}")
    return m.group(1).replace(",", "")


def read_records(path: str) -> list[dict]:
    """Records with question / answer from a .jsonl, .json or .parquet file."""
    if not os.path.isfile(path):
        raise ValueError(f"gsm8k input {path!r} does not exist")
    if path.endswith(".parquet"):
        records = pq.read_table(path).to_pylist()
    elif path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    else:
        raise ValueError(f"gsm8k input {path!r}: expected a .jsonl, .json or .parquet file")
    for i, r in enumerate(records):
        if not isinstance(r.get("question"), str) or not isinstance(r.get("answer"), str):
            raise ValueError(f"{path}: record {i}: needs string fields 'question' and 'answer'")
    return records


def convert_rows(records: list[dict], split: str, source_path: str = "") -> list[dict]:
    """RL rows for GSM8K records."""
    rows = []
    for i, r in enumerate(records):
        try:
            truth = extract_ground_truth(r["answer"])
        except ValueError as e:
            raise ValueError(f"{source_path}: record {i}: {e}") from e
        rows.append(make_row(DATA_SOURCE, f"{r['question']} {INSTRUCTION}", truth, split, i,
                             answer=r["answer"], question=r["question"]))
    return rows


def _find_split_files(directory: str) -> tuple[str, str]:
    files = sorted(glob.glob(os.path.join(directory, "**", "*"), recursive=True))
    files = [f for f in files if f.endswith((".parquet", ".jsonl", ".json"))]
    train = [f for f in files if "train" in os.path.basename(f)]
    test = [f for f in files if "test" in os.path.basename(f)]
    if len(train) != 1 or len(test) != 1:
        raise ValueError(f"{directory}: expected exactly one train* and one test* data file, found "
                         f"train={train} test={test}; pass --input and --test_input")
    return train[0], test[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="training file (jsonl/json/parquet) or a folder")
    p.add_argument("--test_input", default=None, help="test file; default: hold out --test_size rows")
    p.add_argument("--out", "--local_dir", dest="out", required=True, help="output folder")
    p.add_argument("--test_size", type=int, default=500, help="rows held out when there is no test file")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        train_path, test_path = a.input, a.test_input
        if os.path.isdir(train_path):
            train_path, test_path = _find_split_files(train_path)
        train_records = read_records(train_path)
        if test_path:
            test_records = read_records(test_path)
        else:
            if not 0 < a.test_size < len(train_records):
                raise ValueError(f"--test_size must be in 1..{len(train_records) - 1}")
            order = list(range(len(train_records)))
            random.Random(a.seed).shuffle(order)
            held = set(order[:a.test_size])
            test_records = [r for i, r in enumerate(train_records) if i in held]
            train_records = [r for i, r in enumerate(train_records) if i not in held]
        train = convert_rows(train_records, "train", train_path)
        test = convert_rows(test_records, "test", test_path or train_path)
    except ValueError as e:
        p.error(str(e))
    write_splits(a.out, train, test)


if __name__ == "__main__":
    main()
