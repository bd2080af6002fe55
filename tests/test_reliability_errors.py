"""Bad inputs give one line naming the file (and field, row) and the problem: YAML configs, model folders,
data files, ground truths that do not fit the data_source's scorer. train.py prints no traceback unless
TINYZERO_DEBUG=1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tinyzero.cli import parse_args
from tinyzero.config import ConfigError
from tinyzero.data.schema import validate_rl_parquet, write_parquet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("text,expected", [
    ("trainer: {mode: [\n", "not a plain YAML config (while parsing a flow node"),
    ("trainer: !!python/object/apply:os.system ['touch {marker}']\n", "could not determine a constructor for the tag"),
    ("just a string\n", "config section <root> must be a mapping, got str"),
    ("trainer: 5\n", "config section trainer must be a mapping of its fields, got int 5"),
    ("trainer:\n  total_epochs: abc\n", "trainer.total_epochs must be int, got str 'abc'"),
    ("trainer:\n  mode: pppo\n", "trainer.mode='pppo' is not valid (did you mean 'ppo'?); choose one of ['ppo', "),
    ("trainer:\n  total_training_steps: [3]\n", "trainer.total_training_steps must be int or None, got list"),
    ("data:\n  max_prompt_length: 1.5\n", "data.max_prompt_length must be int, got float 1.5"),
])
def test_yaml_config_errors_name_the_file_and_field(tmp_path, text, expected):
    marker = tmp_path / "ran"
    path = tmp_path / "run.yaml"
    path.write_text(text.replace("{marker}", str(marker)))
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    msg = str(err.value)
    assert msg.startswith(f"--config {path}: ") and expected in msg and "\n" not in msg, msg
    assert not marker.exists()


def test_yaml_numbers_written_as_strings_are_numbers(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-6\n")  # YAML 1.1 reads a string
    assert parse_args(["--config", str(path)]).actor_rollout_ref.actor.optim.lr == 1e-6


@pytest.mark.slow
def test_config_folder_and_train_py_prints_one_line(tmp_path):
    (tmp_path / "cfg.yaml").mkdir()
    with pytest.raises(ConfigError, match="is a folder; pass a YAML file"):
        parse_args(["--config", str(tmp_path / "cfg.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: !!python/object/apply:os.system ['true']\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TINYZERO_DEBUG", None)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", str(bad)], env=env,
                         capture_output=True, text=True, timeout=120)
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"config error: --config {bad}: "), \
        out.stderr
    debug = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", str(bad)],
                           env={**env, "TINYZERO_DEBUG": "1"}, capture_output=True, text=True, timeout=120)
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr


@pytest.fixture()
def model_copy(tiny_model_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dst)
    return dst


@pytest.mark.parametrize("name,content,expected", [
    ("config.json", "{not json", "config.json: the model config is not valid JSON (line 1, column 2"),
    ("config.json", "[1, 2]", "config.json: cannot load the model config"),
    ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!garbage!", "model.safetensors: not a readable "
                                                                               "safetensors file"),
    ("model.safetensors", b"", "model.safetensors: not a readable safetensors file"),
    ("tokenizer.json", "{broken", "tokenizer.json: tokenizer.json is not valid JSON (line 1, column 2"),
])
def test_corrupt_model_files_name_the_file(model_copy, name, content, expected):
    from tinyzero.models.loading import load_causal_lm, load_hf_config, load_tokenizer

    path = model_copy / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    loader = {"config.json": load_hf_config, "model.safetensors": load_causal_lm, "tokenizer.json": load_tokenizer}
    with pytest.raises(ValueError) as err:
        loader[name](str(model_copy))
    assert str(model_copy) in str(err.value) and expected in str(err.value), str(err.value)


def test_truncated_safetensors_names_the_file(model_copy):
    from tinyzero.models.loading import load_causal_lm

    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{path}: not a readable safetensors file"):
        load_causal_lm(str(model_copy))


def _row(source: str, truth) -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": "q"}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": 0}}


def test_empty_and_non_parquet_data_files(tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=f"data file '{empty}' is empty \\(0 bytes\\)"):
        validate_rl_parquet(str(empty))
    text = tmp_path / "rows.parquet"
    text.write_text('{"data_source": "countdown"}\n')
    with pytest.raises(ValueError, match=f"data file '{text}' is not a readable parquet file"):
        validate_rl_parquet(str(text))
    with pytest.raises(ValueError, match="is a folder, not a parquet file"):
        validate_rl_parquet(str(tmp_path))


def test_empty_sft_data_file_names_it(tmp_path, tiny_model_dir):
    from tinyzero.data import SFTDataset
    from tinyzero.models.loading import load_tokenizer

    empty = tmp_path / "sft.parquet"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=f"data file '{empty}' is empty \\(0 bytes\\)"):
        SFTDataset(str(empty), load_tokenizer(tiny_model_dir))


@pytest.mark.parametrize("source,truth,field", [
    ("countdown", {"target": "24", "numbers": [1, 2]}, "countdown needs {'target': number"),
    ("countdown_3to4", {"target": 24, "numbers": [1.5, 2]}, "countdown 'numbers' must be a non-empty list of int"),
    ("countdown", {"target": 24, "numbers": []}, "countdown 'numbers' must be a non-empty list of int"),
    ("countdown", "24", "countdown needs"),
    ("arithmetic", "twelve", "arithmetic needs an integer"),
    ("openai/gsm8k", {"answer": 3}, "expected the answer as a string or number, got dict"),
])
def test_ground_truth_of_the_wrong_type_is_refused_at_load(tmp_path, source, truth, field):
    path = tmp_path / "train.parquet"
    write_parquet([_row(source, truth)] * 2, str(path))  # one type per parquet column, so every row is bad
    with pytest.raises(ValueError) as err:
        validate_rl_parquet(str(path))
    msg = str(err.value)
    assert msg.startswith(f"{path}: row 0: reward_model.ground_truth: ") and field in msg, msg
    assert f"(data_source {source!r})" in msg


def test_well_typed_ground_truths_pass(tmp_path):
    rows = [_row("countdown", {"target": 24, "numbers": [3, 8]}), _row("countdown", {"target": 2.5, "numbers": [5.0, 2.0]}),
            _row("arithmetic", 12),
            _row("arithmetic", "12"), _row("gsm8k", "72"), _row("lighteval/MATH", "\\frac{1}{2}"),
            _row("my_own_source", {"anything": [1]})]  # no built-in scorer: not checked here
    for i, row in enumerate(rows):
        write_parquet([row], str(tmp_path / f"{i}.parquet"))
        assert validate_rl_parquet(str(tmp_path / f"{i}.parquet")) == 1
