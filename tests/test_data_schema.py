"""The RL parquet contract: every kind of bad row is reported with file, row index and field."""

from __future__ import annotations

import copy

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tinyzero.data import DataConfig, validate_rl_parquet, write_parquet


def _row(i: int) -> dict:
    return {
        "data_source": "countdown",
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"task {i}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": 24, "numbers": [3, 5, 8]}},
        "extra_info": {"split": "train", "index": i},
    }


def _write(tmp_path, rows, name="d.parquet"):
    path = str(tmp_path / name)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_valid_file_returns_row_count_and_keeps_extra_columns(tmp_path):
    rows = [dict(_row(i), difficulty=i % 3) for i in range(5)]
    path = str(tmp_path / "ok.parquet")
    write_parquet(rows, path)
    assert validate_rl_parquet(path) == 5
    assert pq.read_table(path).column("difficulty").to_pylist() == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("field,mutate,message", [
    ("data_source", lambda r: r.update(data_source=""), "data_source: expected a non-empty string"),
    ("prompt", lambda r: r.update(prompt=[]), "prompt: empty prompt"),
    ("prompt", lambda r: r["prompt"].__setitem__(1, {"role": "narrator", "content": "x"}),
     "prompt[1].role: unknown role 'narrator'"),
    ("prompt", lambda r: r.update(prompt=[{"role": "user", "content": ""}]), "every message content is empty"),
    ("ability", lambda r: r.update(ability=None), "ability: expected a string"),
    ("reward_model", lambda r: r["reward_model"].update(ground_truth=None), "reward_model.ground_truth: missing"),
    ("reward_model", lambda r: r["reward_model"].update(style="vibes"), "reward_model.style"),
    ("extra_info", lambda r: r.update(extra_info=None), "extra_info: expected a dict"),
])
def test_bad_row_is_named(tmp_path, field, mutate, message):
    good = [_row(i) for i in range(4)]
    bad = copy.deepcopy(good[2])
    mutate(bad)
    rows = good[:2] + [bad] + good[3:]
    # Arrow needs a consistent schema: write bad values in columns that allow them.
    path = _write(tmp_path, rows)
    with pytest.raises(ValueError) as e:
        validate_rl_parquet(path)
    text = str(e.value)
    assert path in text and "row 2" in text and message in text, text


def test_missing_column_and_missing_file(tmp_path):
    rows = [_row(i) for i in range(2)]
    for r in rows:
        del r["ability"]
    path = _write(tmp_path, rows)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['ability'\]"):
        validate_rl_parquet(path)
    with pytest.raises(ValueError, match="does not exist"):
        validate_rl_parquet(str(tmp_path / "nope.parquet"))


def test_wrong_prompt_type(tmp_path):
    rows = [dict(_row(i), prompt=f"plain text {i}") for i in range(2)]
    path = _write(tmp_path, rows)
    with pytest.raises(ValueError, match=r"row 0: prompt: expected a list"):
        validate_rl_parquet(path)


def test_data_config_validation():
    assert DataConfig(train_files="a.parquet").train_files == ["a.parquet"]
    with pytest.raises(ValueError, match="data.truncation"):
        DataConfig(truncation="middle")
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        DataConfig(max_prompt_length=0)
    with pytest.raises(ValueError, match="data.val_batch_size"):
        DataConfig(val_batch_size=0)
