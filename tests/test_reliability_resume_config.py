"""Resuming with a config that changes the training is refused naming the fields (old -> new); listed
fields are accepted; safe fields (run length, logging) pass; earlier configs are kept, numbered."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from tinyzero.config import Config, ConfigError
from tinyzero.config.parse import to_dict
from tinyzero.trainer.run_config import changed_fields, write_config


def _cfg(allow_config_change: str = "", **trainer) -> Config:
    cfg = Config()
    cfg.trainer = dataclasses.replace(cfg.trainer, **trainer)
    cfg.reliability.allow_config_change = allow_config_change
    return cfg


def test_math_changes_are_refused_with_old_and_new_values(tmp_path):
    run = str(tmp_path / "run")
    write_config(_cfg(), run, saved_path=None)
    saved = tmp_path / "run" / "config.yaml"
    original = saved.read_text()
    cfg = _cfg(seed=7)
    cfg.actor_rollout_ref.actor.optim.lr = 3e-5
    cfg.data.train_batch_size = 2 * cfg.data.train_batch_size
    cfg.actor_rollout_ref.model.path = "/models/other"
    with pytest.raises(ConfigError) as err:
        write_config(cfg, run, saved_path=str(saved))
    msg = str(err.value)
    default = Config()
    for field, old, new in (("trainer.seed", default.trainer.seed, 7),
                            ("actor_rollout_ref.actor.optim.lr", default.actor_rollout_ref.actor.optim.lr, 3e-5),
                            ("data.train_batch_size", default.data.train_batch_size, cfg.data.train_batch_size),
                            ("actor_rollout_ref.model.path", default.actor_rollout_ref.model.path, "/models/other")):
        assert f"{field}: {old!r} -> {new!r}" in msg, msg
    assert "--reliability.allow_config_change" in msg
    assert saved.read_text() == original, "a refused resume must not overwrite config.yaml"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml"]
    # Naming every field (or "all") accepts them; the earlier config is kept as config.1.yaml.
    cfg.reliability.allow_config_change = ("trainer.seed,actor_rollout_ref.actor.optim.lr,data.train_batch_size,"
                                       "actor_rollout_ref.model.path")
    write_config(cfg, run, saved_path=str(saved))
    assert (tmp_path / "run" / "config.1.yaml").read_text() == original
    assert yaml.safe_load(saved.read_text())["trainer"]["seed"] == 7
    partial = _cfg(seed=8, allow_config_change="actor_rollout_ref.actor.optim.lr")
    with pytest.raises(ConfigError, match=r"trainer.seed: 7 -> 8"):
        write_config(partial, run, saved_path=str(saved))
    write_config(_cfg(seed=8, allow_config_change="all"), run, saved_path=str(saved))
    assert (tmp_path / "run" / "config.2.yaml").exists()


def test_safe_changes_pass_and_identical_configs_add_no_history(tmp_path):
    run = str(tmp_path / "run")
    write_config(_cfg(), run, saved_path=None)
    saved = str(tmp_path / "run" / "config.yaml")
    write_config(_cfg(), run, saved_path=saved)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml"]
    longer = _cfg(total_training_steps=50, save_freq=10, logger=["console"], experiment_name="more")
    longer.actor_rollout_ref.actor.optim.total_training_steps = 50  # derived from the run length
    longer.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 1  # exact under any micro-batch split
    longer.actor_rollout_ref.actor.fsdp_config.param_offload = True
    write_config(longer, run, saved_path=saved)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.1.yaml", "config.yaml"]


def test_changed_fields_against_a_flat_reference():
    old = to_dict(Config())
    new = to_dict(Config())
    new["trainer"]["seed"] = 3
    new["data"]["extra_new_field"] = 1  # a field only the newer version has is not a change
    assert changed_fields(old, new) == {"trainer.seed": (old["trainer"]["seed"], 3)}
