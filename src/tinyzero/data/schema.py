"""The RL parquet contract: five fields per row, validated with errors that name file, row and field.

A training row holds
    data_source   str, non-empty            picks the reward function
    prompt        list of {"role", "content"} chat messages, non-empty, known roles
    ability       str                       e.g. "math"
    reward_model  {"style": "rule"|"model", "ground_truth": ...}  (ground_truth: str, number,
                  list or dict such as {"target": 24, "numbers": [3, 5, 8]})
    extra_info    dict                      e.g. {"split": "train", "index": 7}
Other columns are allowed and are passed through to the batch's non-tensors.

The ground truth is also checked against what the built-in scorer of the row's data_source
reads (GROUND_TRUTH_CHECKS, resolved through the reward registry's lookup): a countdown row
whose ground truth lacks "target" would otherwise train on reward 0. A file that is empty or
not parquet is one error naming it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "REQUIRED_FIELDS",
    "ROLES",
    "GROUND_TRUTH_CHECKS",
    "check_ground_truth",
    "open_parquet",
    "validate_rl_row",
    "validate_rl_parquet",
    "iter_parquet_rows",
    "load_rl_parquet",
    "write_parquet",
]

REQUIRED_FIELDS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
ROLES = ("system", "user", "assistant", "tool")
_STYLES = ("rule", "model")
_READ_BATCH_ROWS = 8192


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        what = "is a folder, not a parquet file" if os.path.isdir(path) else "does not exist"
        raise ValueError(f"data file {path!r} {what} (check data.train_files / data.val_files)")
    if os.path.getsize(path) == 0:
        raise ValueError(f"data file {path!r} is empty (0 bytes); write it again (was its writer interrupted?)")


def open_parquet(path: str) -> pq.ParquetFile:
    """pq.ParquetFile of `path`; a missing, empty or non-parquet file is a ValueError naming it."""
    _check_file(path)
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"data file {path!r} is not a readable parquet file ({e}); write it with "
                         "tinyzero.data.write_parquet or pandas.DataFrame.to_parquet") from None


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _countdown_truth(gt) -> str | None:
    if not isinstance(gt, dict) or not _is_number(gt.get("target")) or not isinstance(gt.get("numbers"), list):
        return f"countdown needs {{'target': number, 'numbers': [int, ...]}}, got {gt!r}"[:200]
    # Parquet may store the numbers as floats (a column unifies its rows' types): whole floats are fine.
    if not gt["numbers"] or not all(_is_number(n) and float(n).is_integer() for n in gt["numbers"]):
        return f"countdown 'numbers' must be a non-empty list of integers, got {gt['numbers']!r}"[:200]
    return None


def _integer_truth(gt) -> str | None:
    try:
        int(str(gt).strip())
    except ValueError:
        return f"arithmetic needs an integer (or its string), got {gt!r}"[:200]
    return None if not isinstance(gt, (dict, list, bool)) else f"arithmetic needs an integer, got {gt!r}"[:200]


def _scalar_truth(gt) -> str | None:
    if isinstance(gt, (str, int, float)) and not isinstance(gt, bool):
        return None
    return f"expected the answer as a string or number, got {type(gt).__name__} {gt!r}"[:200]


GROUND_TRUTH_CHECKS = {"countdown": _countdown_truth, "arithmetic": _integer_truth, "gsm8k": _scalar_truth,
                       "math": _scalar_truth}
"""Built-in scorer name -> check of the ground truth it reads (None if fine, else the problem)."""


def check_ground_truth(data_source: str, ground_truth) -> str | None:
    """The problem with `ground_truth` for the built-in scorer `data_source` resolves to, or None.

    Data sources without a built-in scorer (user-registered ones) are not checked.
    """
    from tinyzero.rewards.registry import SCORERS, SUBSTRING_RULES

    fn = SCORERS.get(data_source)
    if fn is None:
        name = next((name for subs, name in SUBSTRING_RULES if any(s in data_source for s in subs)), None)
        fn = SCORERS.get(name) if name else None
    for name, check in GROUND_TRUTH_CHECKS.items():
        if fn is not None and SCORERS.get(name) is fn:
            return check(ground_truth)
    return None


def validate_rl_row(row: dict, prompt_key: str = "prompt") -> str | None:
    """None if the row follows the contract, else 'field: problem'."""
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        return f"data_source: expected a non-empty string, got {source!r}"[:200]
    messages = row.get(prompt_key)
    if not isinstance(messages, list):
        return f"{prompt_key}: expected a list of {{'role', 'content'}} messages, got {type(messages).__name__}"
    if not messages:
        return f"{prompt_key}: empty prompt (no messages)"
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict):
            return f"{prompt_key}[{j}]: expected a {{'role', 'content'}} dict, got {type(msg).__name__}"
        role = msg.get("role")
        if role not in ROLES:
            return f"{prompt_key}[{j}].role: unknown role {role!r}, expected one of {ROLES}"
        if not isinstance(msg.get("content"), str):
            return f"{prompt_key}[{j}].content: expected a string, got {type(msg.get('content')).__name__}"
    if not any(msg["content"] for msg in messages):
        return f"{prompt_key}: empty prompt (every message content is empty)"
    ability = row.get("ability")
    if not isinstance(ability, str):
        return f"ability: expected a string, got {type(ability).__name__}"
    rm = row.get("reward_model")
    if not isinstance(rm, dict):
        return f"reward_model: expected a dict with 'style' and 'ground_truth', got {type(rm).__name__}"
    if rm.get("ground_truth") is None:
        return "reward_model.ground_truth: missing"
    if "style" in rm and rm["style"] not in _STYLES:
        return f"reward_model.style: expected one of {_STYLES}, got {rm['style']!r}"
    problem = check_ground_truth(source, rm["ground_truth"])
    if problem is not None:
        return f"reward_model.ground_truth: {problem} (data_source {source!r})"
    extra = row.get("extra_info")
    if not isinstance(extra, dict):
        return f"extra_info: expected a dict, got {type(extra).__name__}"
    return None


def iter_parquet_rows(path: str, columns: list[str] | None = None) -> Iterator[dict]:
    """Rows of a parquet file as Python dicts, read in record batches (bounded memory)."""
    pf = open_parquet(path)
    for batch in pf.iter_batches(batch_size=_READ_BATCH_ROWS, columns=columns):
        yield from batch.to_pylist()


def _check_columns(path: str, names: list[str], prompt_key: str) -> None:
    required = [prompt_key if f == "prompt" else f for f in REQUIRED_FIELDS]
    missing = [f for f in required if f not in names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; an RL row needs {list(required)} "
                         f"(found {names})")


def validate_rl_parquet(path: str, prompt_key: str = "prompt") -> int:
    """Validate every row of an RL parquet file; return the number of rows.

    Raises ValueError naming the file, the row index and the field of the first bad row.
    """
    names = open_parquet(path).schema_arrow.names
    _check_columns(path, names, prompt_key)
    n = 0
    for i, row in enumerate(iter_parquet_rows(path)):
        problem = validate_rl_row(row, prompt_key)
        if problem is not None:
            raise ValueError(f"{path}: row {i}: {problem}")
        n += 1
    return n


def load_rl_parquet(path: str, prompt_key: str = "prompt") -> pa.Table:
    """Read an RL parquet file into an arrow table after validating every row."""
    validate_rl_parquet(path, prompt_key)
    return pq.read_table(path)


def write_parquet(rows: list[dict], path: str) -> None:
    """Write rows (dicts with the same keys) to a parquet file atomically (temp file + rename)."""
    if not rows:
        raise ValueError(f"write_parquet: no rows to write to {path!r}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    table = pa.Table.from_pylist(rows)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
