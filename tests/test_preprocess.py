"""Preprocessors: determinism by seed, solvable countdown tasks, gsm8k conversion, arithmetic demo rows."""

from __future__ import annotations

import itertools
import os
import re
import shutil
from fractions import Fraction
from functools import cache

import pyarrow.parquet as pq
import pytest

from tinyzero.data import validate_rl_parquet
from tinyzero.data.preprocess import arithmetic, countdown, gsm8k, multiply
from tinyzero.rewards import default_compute_score

ASSETS = os.path.join(os.path.dirname(__file__), "assets")


@cache
def _reachable(numbers: tuple) -> frozenset:
    """Every value reachable with + - * / using each number exactly once (exhaustive, exact fractions)."""
    if len(numbers) == 1:
        return frozenset({Fraction(numbers[0])})
    out = set()
    n = len(numbers)
    for r in range(1, n):
        for left in itertools.combinations(range(n), r):
            right = tuple(i for i in range(n) if i not in left)
            for a in _reachable(tuple(sorted(numbers[i] for i in left))):
                for b in _reachable(tuple(sorted(numbers[i] for i in right))):
                    out.update({a + b, a - b, a * b})
                    if b != 0:
                        out.add(a / b)
    return frozenset(out)


def test_countdown_tasks_are_solvable_and_deterministic():
    rows = countdown.generate_rows(150, seed=5)
    assert rows == countdown.generate_rows(150, seed=5)
    assert rows != countdown.generate_rows(150, seed=6)
    for row in rows:
        gt = row["reward_model"]["ground_truth"]
        assert 3 <= len(gt["numbers"]) <= 4 and all(1 <= x <= 99 for x in gt["numbers"])
        assert 1 <= gt["target"] <= 100
        assert Fraction(gt["target"]) in _reachable(tuple(sorted(gt["numbers"])))
        solution = row["extra_info"]["solution"]
        assert default_compute_score("countdown", f"<answer>{solution}</answer>", gt) == 1.0
        assert row["data_source"] == "countdown" and row["ability"] == "math"


def test_countdown_templates():
    base = countdown.make_prompt(24, [3, 5, 8], "base")
    assert base.startswith("A conversation between User and Assistant.")
    assert "Using the numbers [3, 5, 8], create an equation that equals 24." in base
    assert base.endswith("\nAssistant: Let me solve this step by step.\n<think>")
    qwen = countdown.make_prompt(24, [3, 5, 8], "qwen-instruct")
    assert qwen.startswith("<|im_start|>system\n") and qwen.endswith("<|im_start|>assistant\nLet me solve this step by step.\n<think>")
    with pytest.raises(ValueError, match="template_type"):
        countdown.make_prompt(1, [1], "chatml")


def test_countdown_cli(tmp_path, capsys):
    out = str(tmp_path / "cd")
    countdown.main(["--out", out, "--train_size", "40", "--test_size", "8", "--template_type", "qwen-instruct"])
    printed = capsys.readouterr().out
    assert "wrote 40 rows" in printed and "wrote 8 rows" in printed
    assert validate_rl_parquet(os.path.join(out, "train.parquet")) == 40
    assert validate_rl_parquet(os.path.join(out, "test.parquet")) == 8
    row = pq.read_table(os.path.join(out, "test.parquet")).slice(0, 1).to_pylist()[0]
    assert row["extra_info"]["split"] == "test" and isinstance(row["reward_model"]["ground_truth"]["numbers"], list)


def test_gsm8k_conversion_and_cli(tmp_path, capsys):
    src = os.path.join(ASSETS, "gsm8k_sample.jsonl")
    records = gsm8k.read_records(src)
    rows = gsm8k.convert_rows(records, "train")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["27", "19", "10000", "-5", "2.5", "155"]
    assert rows[0]["prompt"][0]["content"].endswith(
        'loaves does she make in a day? Let\'s think step by step and output the final answer after "####".')
    assert rows[0]["data_source"] == "openai/gsm8k"
    # The reference answers score 1.0 under the strict rule.
    assert all(default_compute_score("openai/gsm8k", r["extra_info"]["answer"], r["reward_model"]["ground_truth"])
               == 1.0 for r in rows)

    out = str(tmp_path / "g1")
    gsm8k.main(["--input", src, "--out", out, "--test_size", "2", "--seed", "1"])
    assert validate_rl_parquet(os.path.join(out, "train.parquet")) == 4
    assert validate_rl_parquet(os.path.join(out, "test.parquet")) == 2
    assert "wrote 4 rows" in capsys.readouterr().out

    folder = tmp_path / "hf_layout" / "main"
    folder.mkdir(parents=True)
    shutil.copy(src, folder / "train.jsonl")
    pq.write_table(pq.read_table(os.path.join(out, "train.parquet")).select(["extra_info"]).flatten()
                   .rename_columns(["split", "index", "answer", "question"]), str(folder / "test.parquet"))
    out2 = str(tmp_path / "g2")
    gsm8k.main(["--input", str(tmp_path / "hf_layout"), "--out", out2])
    assert validate_rl_parquet(os.path.join(out2, "train.parquet")) == 6
    assert validate_rl_parquet(os.path.join(out2, "test.parquet")) == 4


def test_gsm8k_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match="record 0"):
        gsm8k.convert_rows(gsm8k.read_records(str(bad)), "train", str(bad))
    with pytest.raises(SystemExit):
        gsm8k.main(["--input", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")])


def test_arithmetic_plain_demo_rows():
    rows = arithmetic.generate_rows(300, seed=0, digits=2, ops="+-*", style="plain")
    assert rows == arithmetic.generate_rows(300, seed=0, digits=2, ops="+-*", style="plain")
    for row in rows:
        content = row["prompt"][0]["content"]
        assert content.isascii() and len(content) < 40
        a, op, b = re.fullmatch(r"(\d+)([+\-*])(\d+)=", content).groups()
        truth = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert truth >= 0 and row["reward_model"]["ground_truth"] == str(truth)
        assert row["data_source"] == "arithmetic" and row["extra_info"]["answer_format"] == "plain"
        gt, extra = row["reward_model"]["ground_truth"], row["extra_info"]
        assert default_compute_score("arithmetic", str(truth), gt, extra) == 1.0
        assert default_compute_score("arithmetic", str(truth + 1), gt, extra) == pytest.approx(0.1)
    assert len({r["prompt"][0]["content"] for r in rows}) > 200


def test_arithmetic_splits_and_cli(tmp_path, capsys):
    train, test = arithmetic.generate_splits(200, 50, seed=3, digits=2, ops="*")
    train_problems = {r["prompt"][0]["content"] for r in train}
    assert len(train_problems) == 200 and not train_problems & {r["prompt"][0]["content"] for r in test}
    tagged = arithmetic.generate_rows(3, seed=0, digits=3, style="tagged")
    assert tagged[0]["prompt"][0]["content"].endswith("Assistant: Let me solve this step by step.\n<think>")
    gt = tagged[0]["reward_model"]["ground_truth"]
    assert default_compute_score("arithmetic", f"<answer>{gt}</answer>", gt, tagged[0]["extra_info"]) == 1.0
    with pytest.raises(ValueError, match="distinct"):
        arithmetic.generate_rows(100, digits=1, ops="+", unique=True)

    out = str(tmp_path / "mul")
    multiply.main(["--out", out, "--train_size", "30", "--test_size", "5", "--digits", "2"])
    assert "wrote 30 rows" in capsys.readouterr().out
    row = pq.read_table(os.path.join(out, "train.parquet")).slice(0, 1).to_pylist()[0]
    assert row["data_source"] == "multiply" and " * " in row["prompt"][0]["content"]
    out = str(tmp_path / "demo")
    arithmetic.main(["--out", out, "--train_size", "150", "--test_size", "20", "--digits", "1", "--ops", "+",
                     "--style", "plain"])
    assert validate_rl_parquet(os.path.join(out, "train.parquet")) == 150
