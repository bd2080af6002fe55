"""The command line speaks Hydra's override grammar (as veRL's scripts write it) beside tinyzero's flags.

Cases follow Hydra's documented grammar (hydra.cc, "Override grammar": basic and extended forms):
`key=value`, `+key=value`, `++key=value`, `~key`, typed values (int, float, bool, null, lists,
dicts, quoted strings), mixed with `--section.field VALUE` flags, the later setting winning.
"""

from __future__ import annotations

import pytest

from tinyzero.cli import parse_args
from tinyzero.config import ConfigError
from tinyzero.config.parse import load_yaml


def test_key_value_typed_as_hydra_types_them():
    cfg = parse_args(["trainer.total_epochs=3", "actor_rollout_ref.actor.optim.lr=1e-6",
                      "trainer.val_before_train=False", "trainer.total_training_steps=null",
                      "actor_rollout_ref.rollout.temperature=0.7"])
    assert cfg.trainer.total_epochs == 3 and isinstance(cfg.trainer.total_epochs, int)
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.trainer.val_before_train is False
    assert cfg.trainer.total_training_steps is None
    assert cfg.actor_rollout_ref.rollout.temperature == 0.7


@pytest.mark.parametrize("text", ["true", "True", "TRUE"])
def test_booleans_in_any_case(text):
    assert parse_args([f"trainer.val_only={text}"]).trainer.val_only is True
    assert parse_args(["--trainer.val_only", text]).trainer.val_only is True


def test_add_force_add_and_delete():
    cfg = parse_args(["+trainer.val_before_train=False", "++trainer.total_epochs=4"])
    assert cfg.trainer.val_before_train is False and cfg.trainer.total_epochs == 4
    # `~key` takes the field back to tinyzero's default, whatever the preset or an earlier setting said
    cfg = parse_args(["--preset", "demo_cpu", "trainer.total_epochs=9", "~trainer.total_epochs"])
    assert cfg.trainer.total_epochs == 1


def test_lists_as_hydra_writes_them():
    assert parse_args(["trainer.logger=['console','jsonl']"]).trainer.logger == ["console", "jsonl"]
    assert parse_args(["trainer.logger=[console]"]).trainer.logger == ["console"]
    assert parse_args(["trainer.logger=console"]).trainer.logger == ["console"]
    # veRL's scripts pass "['$HOME/a.parquet', '$HOME/b.parquet']" quoted by the shell: one argument
    cfg = parse_args(["data.train_files=['/d/gsm8k/train.parquet', '/d/math/train.parquet']"])
    assert cfg.data.train_files == ["/d/gsm8k/train.parquet", "/d/math/train.parquet"]
    cfg = parse_args(["data.train_files=/d/gsm8k/train.parquet"])
    assert cfg.data.train_files == ["/d/gsm8k/train.parquet"]
    assert parse_args(["actor_rollout_ref.actor.optim.betas=[0.8,0.95]"]).actor_rollout_ref.actor.optim.betas == (0.8, 0.95)
    # tinyzero's own list syntax still works, an empty list too
    assert parse_args(["--trainer.logger", "console", "jsonl"]).trainer.logger == ["console", "jsonl"]
    assert parse_args(["--data.val_files", "--trainer.seed", "3"]).data.val_files == []


def test_quoted_strings_keep_spaces_equals_and_leading_zeros():
    assert parse_args(["trainer.experiment_name='my run=1'"]).trainer.experiment_name == "my run=1"
    assert parse_args(['trainer.experiment_name="a,b"']).trainer.experiment_name == "a,b"
    assert parse_args(["trainer.experiment_name=007"]).trainer.experiment_name == "007"
    assert parse_args(["trainer.experiment_name=1e-6"]).trainer.experiment_name == "1e-6"
    assert parse_args(["trainer.project_name=${oc.env:HOME}"]).trainer.project_name == "${oc.env:HOME}"


def test_mapping_on_a_section():
    cfg = parse_args(["actor_rollout_ref.actor.optim={lr:2e-6,weight_decay:0.1}"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 2e-6 and cfg.actor_rollout_ref.actor.optim.weight_decay == 0.1


def test_flags_and_overrides_mix_and_the_later_wins():
    assert parse_args(["--trainer.total_epochs", "2", "trainer.total_epochs=3"]).trainer.total_epochs == 3
    assert parse_args(["trainer.total_epochs=3", "--trainer.total_epochs", "2"]).trainer.total_epochs == 2
    assert parse_args(["--trainer.total_epochs=5", "trainer.seed=7"]).trainer.seed == 7
    cfg = parse_args(["sft", "--preset", "sft", "trainer.total_epochs=2", "--trainer.seed", "3"])
    assert (cfg.trainer.mode, cfg.trainer.total_epochs, cfg.trainer.seed) == ("sft", 2, 3)


@pytest.mark.parametrize("args,match", [
    (["trainer.total_epoch=3"], r"unknown setting trainer\.total_epoch .*did you mean 'trainer\.total_epochs'"),
    (["trainer.total_epochs=[1,"], r"cannot parse the override 'trainer\.total_epochs=\[1,'"),
    (["trainer.total_epochs=abc"], r"trainer\.total_epochs must be int, got str 'abc'"),
    (["trainer.device=tpu"], r"trainer\.device='tpu' is not valid.*choose one of \['auto', 'cpu', 'cuda'\]"),
    (["reward.timeout_s=nan"], r"reward\.timeout_s must be a finite number"),
    (["--reliability.collective_timeout_s", "inf"], r"reliability\.collective_timeout_s must be a finite number"),
    (["stray"], r"unexpected argument 'stray'"),
    (["--trainer.seed"], r"--trainer\.seed needs a value"),
])
def test_bad_settings_are_one_line(args, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_args(args)
    assert "\n" not in str(err.value)


VERL_STYLE_YAML = """\
defaults:
  - ppo_trainer
  - _self_
hydra:
  searchpath: []
data:
  train_batch_size: 256
  max_prompt_length: 64
  max_response_length: ${data.max_prompt_length}
actor_rollout_ref:
  actor:
    _target_: verl.workers.config.FSDPActorConfig
    optim:
      lr: 1e-6
  rollout:
    n: 4
trainer:
  total_epochs: 2
  experiment_name: ${trainer.project_name}_x
"""


def test_verl_style_yaml_loads(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(VERL_STYLE_YAML)
    cfg = load_yaml(str(path))
    assert cfg.data.train_batch_size == 256 and cfg.data.max_response_length == 64
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6 and cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.trainer.experiment_name == "tinyzero_x"
    # veRL's launcher form: --config-path DIR --config-name NAME, then overrides on top
    cfg = parse_args(["--config-path", str(tmp_path), "--config-name", "verl", "trainer.total_epochs=3"])
    assert cfg.trainer.total_epochs == 3 and cfg.actor_rollout_ref.rollout.n == 4


def test_entries_of_a_mapping_field():
    cfg = parse_args(["+custom_reward_function.reward_kwargs.weight=0.5",
                      "+custom_reward_function.reward_kwargs.mode=strict",
                      "++actor_rollout_ref.model.override_config.attention_dropout=0.0"])
    assert cfg.custom_reward_function.reward_kwargs == {"weight": 0.5, "mode": "strict"}
    assert cfg.actor_rollout_ref.model.override_config == {"attention_dropout": 0.0}
    cfg = parse_args(["custom_reward_function.reward_kwargs={a:1,b:2}", "~custom_reward_function.reward_kwargs.a"])
    assert cfg.custom_reward_function.reward_kwargs == {"b": 2}
