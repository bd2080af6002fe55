"""Task generators and converters that write RL parquet files (train.parquet, test.parquet).

    python -m tinyzero.data.preprocess.countdown --out data/countdown [--train_size N --test_size N]
    python -m tinyzero.data.preprocess.gsm8k --input gsm8k/train.jsonl --test_input gsm8k/test.jsonl --out data/gsm8k
    python -m tinyzero.data.preprocess.arithmetic --out data/arith [--digits 3 --ops '*' --style tagged]
    python -m tinyzero.data.preprocess.multiply --out data/multiply

Each module also exposes `generate_rows(...) -> list[dict]` (or `convert_rows`) so tests and
the CPU demo can build data in-process, and `write_parquet(rows, path)`.
"""

from tinyzero.data.preprocess.common import write_parquet, write_splits

__all__ = ["write_parquet", "write_splits"]
