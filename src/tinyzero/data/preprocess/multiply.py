"""Multiplication tasks (TinyZero's "multiply"): the arithmetic generator with '*' and data_source "multiply".

    python -m tinyzero.data.preprocess.multiply --out data/multiply [--digits 3 --train_size N --test_size N]
"""

from tinyzero.data.preprocess.arithmetic import main as _arithmetic_main


def main(argv: list[str] | None = None) -> None:
    _arithmetic_main(argv, default_ops="*", default_source="multiply")


if __name__ == "__main__":
    main()
