"""Root config: presets, YAML round trip, CLI flags over presets, unknown keys, cross-field checks."""

from __future__ import annotations

import dataclasses

import pytest
from tinyzero.configs import PRESETS

from tinyzero.cli import load_preset, parse_args
from tinyzero.config import Config, check_model_context
from tinyzero.config.parse import dump_yaml, load_yaml, merge_dict, to_dict
from tinyzero.plan import plan_run

REQUIRED_PRESETS = {"demo_cpu", "countdown_qwen2_5_3b_ppo", "countdown_qwen2_5_3b_grpo", "gsm8k_grpo", "sft", "rm"}


def test_required_presets_exist():
    assert REQUIRED_PRESETS <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_yaml_round_trip(name, tmp_path):
    cfg = PRESETS[name]()
    path = tmp_path / "config.yaml"
    dump_yaml(cfg, str(path))
    assert load_yaml(str(path)) == cfg


def test_countdown_ppo_matches_tinyzero_script():
    cfg = load_preset("countdown_qwen2_5_3b_ppo")
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (256, 256, 1024)
    a = cfg.actor_rollout_ref.actor
    assert (a.optim.lr, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.entropy_coeff) == (1e-6, 64, 8, 0.001)
    assert cfg.critic.optim.lr == 1e-5
    assert cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.use_kl_in_reward
    assert (cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.kl_coef) == ("fixed", 0.001)
    assert cfg.actor_rollout_ref.rollout.n == 1 and cfg.actor_rollout_ref.rollout.temperature == 1.0
    assert (cfg.trainer.total_epochs, cfg.trainer.test_freq, cfg.trainer.save_freq) == (15, 100, 100)
    # the rest of scripts/train_tiny_zero.sh over veRL's ppo_trainer.yaml of the time
    assert not cfg.trainer.val_before_train
    assert a.use_dynamic_bsz and a.ppo_max_token_len_per_gpu == 16384
    r, ref, c = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref, cfg.critic
    assert r.log_prob_use_dynamic_bsz and ref.log_prob_use_dynamic_bsz and c.use_dynamic_bsz
    assert (r.log_prob_max_token_len_per_gpu, ref.log_prob_max_token_len_per_gpu) == (16384, 16384)
    assert (c.ppo_max_token_len_per_gpu, c.forward_max_token_len_per_gpu) == (32768, 32768)
    m = cfg.actor_rollout_ref.model
    assert not m.enable_gradient_checkpointing and not c.model.enable_gradient_checkpointing
    assert m.dtype == "fp32" and c.model.dtype == "fp32"
    assert (r.tensor_model_parallel_size, r.gpu_memory_utilization, r.n) == (2, 0.4, 1)
    assert (cfg.data.val_batch_size, c.ppo_mini_batch_size, c.cliprange_value) == (1312, 64, 0.5)


def test_grpo_variant_changes_only_a_few_fields():
    ppo, grpo = load_preset("countdown_qwen2_5_3b_ppo"), load_preset("countdown_qwen2_5_3b_grpo")
    assert grpo.algorithm.adv_estimator == "grpo" and grpo.actor_rollout_ref.rollout.n == 5
    assert grpo.actor_rollout_ref.actor.use_kl_loss and grpo.actor_rollout_ref.actor.kl_loss_type == "low_var_kl"
    assert grpo.actor_rollout_ref.actor.kl_loss_coef == 0.001 and not grpo.algorithm.use_kl_in_reward
    assert not grpo.use_critic and ppo.use_critic
    assert grpo.data == ppo.data


def test_cli_flags_override_preset_and_yaml(tmp_path):
    cfg = parse_args(["--preset", "countdown_qwen2_5_3b_grpo", "--actor_rollout_ref.actor.optim.lr", "3e-6",
                      "--trainer.total_training_steps", "7"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-6 and cfg.trainer.total_training_steps == 7
    assert cfg.actor_rollout_ref.rollout.n == 5  # from the preset
    path = tmp_path / "run.yaml"
    dump_yaml(cfg, str(path))
    again = parse_args(["--config", str(path), "--data.train_batch_size", "128"])
    assert again.data.train_batch_size == 128
    assert dataclasses.replace(again, data=cfg.data) == cfg


def test_mode_argument_sets_trainer_mode():
    assert parse_args(["sft", "--preset", "sft"]).trainer.mode == "sft"
    assert parse_args(["dpo", "--dpo.beta", "0.2"]).dpo.beta == 0.2


def test_unknown_yaml_key_names_nearest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lrr: 1.0e-6\n")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.optim\.lrr.*did you mean 'lr'"):
        load_yaml(str(path))
    path.write_text("trainr:\n  seed: 3\n")
    with pytest.raises(ValueError, match=r"'trainr'.*did you mean 'trainer'"):
        load_yaml(str(path))


def test_unknown_preset_names_nearest():
    with pytest.raises(ValueError, match="did you mean 'demo_cpu'"):
        load_preset("demo_cpuu")


def test_grpo_needs_group():
    with pytest.raises(ValueError, match=r"rollout\.n >= 2"):
        merge_dict(Config(), {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"rollout": {"n": 1}}})


def test_batch_divisibility_messages():
    cfg = merge_dict(Config(), {"data": {"train_batch_size": 12},
                                "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 6,
                                                                "ppo_micro_batch_size_per_gpu": 4}}})
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu"):
        _check_world(cfg, 3)
    cfg = merge_dict(Config(), {"data": {"train_batch_size": 10},
                                "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 5}}})
    with pytest.raises(ValueError, match="multiple of 4"):
        _check_world(cfg, 4)
    _check_world(merge_dict(Config(), {"data": {"train_batch_size": 16},
                                      "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8}}}), 4)


def test_tp_must_divide_world():
    cfg = merge_dict(Config(), {"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 3}}})
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3"):
        _check_world(cfg, 4)


def test_split_placement_needs_two_ranks():
    cfg = merge_dict(Config(), {"pipeline": {"placement": "split"}})
    with pytest.raises(ValueError, match="at least 2 ranks"):
        _check_world(cfg, 1)


def test_lengths_vs_context():
    cfg = merge_dict(Config(), {"data": {"max_prompt_length": 100, "max_response_length": 50}})
    check_model_context(cfg, 150)
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        check_model_context(cfg, 128)


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import tinyzero.config.root as mod

    tree = ast.parse(inspect.getsource(mod))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("TrainerConfig", "DPOConfig", "Config"):
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                        f"{node.name}.{stmt.target.id} has no docstring"


def test_to_dict_is_plain():
    d = to_dict(load_preset("demo_cpu"))
    assert isinstance(d["actor_rollout_ref"]["actor"]["optim"]["betas"], list)


def test_unknown_flag_names_nearest():
    with pytest.raises(ValueError, match=r"unknown flag --trainer\.total_epoch .*did you mean 'trainer\.total_epochs'"):
        parse_args(["--preset", "demo_cpu", "--trainer.total_epoch", "3"])
    with pytest.raises(ValueError, match=r"--actor_rollout_ref\.actor\.optim\.lrr .*'actor_rollout_ref\.actor\.optim\.lr'"):
        parse_args(["--actor_rollout_ref.actor.optim.lrr=1e-6"])
    # A setting that moved to another section is found by its name.
    with pytest.raises(ValueError, match=r"did you mean 'tuning\.shm_collectives'"):
        parse_args(["--actor_rollout_ref.actor.fsdp_config.shm_collectives", "false"])
    with pytest.raises(ValueError, match=r"did you mean 'tuning\.shm_collectives'"):
        parse_args(["critic.fsdp_config.shm_collectives=false"])


def test_shared_memory_collectives_follow_the_device_unless_set():
    """tuning.shm_collectives: unset is on for CPU runs and off on GPU hosts; a value the user sets is kept."""
    cfg = parse_args(["--preset", "demo_cpu"])
    assert cfg.tuning.shm_collectives is None
    assert cfg.tuning.use_shm_collectives(on_cpu=True) and not cfg.tuning.use_shm_collectives(on_cpu=False)
    off = parse_args(["--preset", "demo_cpu", "tuning.shm_collectives=false"])
    assert not off.tuning.use_shm_collectives(on_cpu=True)


@pytest.mark.slow
def test_help_lists_every_flag():
    import os
    import subprocess
    import sys

    from tinyzero.config.parse import flag_names

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "train.py"), "--help"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    missing = [name for name in flag_names() if f"--{name}" not in out.stdout]
    assert not missing, missing


def test_vllm_rollout_needs_colocated_placement():
    cfg = merge_dict(Config(), {"pipeline": {"placement": "split"},
                                "actor_rollout_ref": {"rollout": {"name": "vllm"}}})
    with pytest.raises(ValueError, match="placement=colocate"):
        _check_world(cfg, 4)


def test_rollout_log_prob_batching_follows_a_dynamic_actor():
    from tinyzero.plan import sync_derived_fields

    cfg = merge_dict(Config(), {"actor_rollout_ref": {"actor": {"use_dynamic_bsz": True,
                                                                "ppo_max_token_len_per_gpu": 4096}}})
    rollout = sync_derived_fields(cfg).actor_rollout_ref.rollout
    assert rollout.log_prob_use_dynamic_bsz and rollout.log_prob_max_token_len_per_gpu == 4096


def test_weight_sync_bucket_defaults_by_device():
    import torch

    from tinyzero.rollout.config import RolloutConfig, sync_bucket_bytes

    auto = RolloutConfig()
    assert auto.weight_sync_bucket_mb == 0
    assert sync_bucket_bytes(auto, torch.device("cpu")) == 32 << 20
    assert sync_bucket_bytes(auto, torch.device("cuda", 0)) == 512 << 20
    assert sync_bucket_bytes(RolloutConfig(weight_sync_bucket_mb=8), torch.device("cuda", 0)) == 8 << 20
    with pytest.raises(ValueError, match="weight_sync_bucket_mb must be >= 0"):
        RolloutConfig(weight_sync_bucket_mb=-1)


def _check_world(cfg, world_size):
    """The world-size rules: the run plan's."""
    return plan_run(cfg, world_size, notice=None)
