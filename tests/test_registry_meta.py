"""Registries carry their metadata: estimators' needs, losses' aggregation, one table per mode list.

The config checks and the trainer read the registry entries, so a new estimator or loss registered
with its flags is checked like the built-in ones, and no list of names is kept beside a registry.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import tinyzero.workers.config as workers_config
from tinyzero.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    get_adv_estimator_spec,
    get_policy_loss_spec,
    kl_penalty,
    register_adv_est,
    register_policy_loss,
)
from tinyzero.algorithms.config import AlgorithmConfig
from tinyzero.cli import load_preset, parse_args
from tinyzero.config import ConfigError, check_config

GROUPED = {"grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"}


def _required(fn) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items()
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def test_estimator_flags_match_what_they_read():
    assert {n for n, s in ADV_ESTIMATORS.items() if s.needs_groups} >= GROUPED
    assert get_adv_estimator_spec("gae").needs_critic and get_adv_estimator_spec("remax").needs_baseline
    for name, spec in ADV_ESTIMATORS.items():  # the flags agree with the inputs each estimator requires
        required = _required(spec.fn)
        assert spec.needs_groups == ("index" in required), name
        assert spec.needs_critic == ("values" in required), name
        assert spec.needs_baseline == ("reward_baselines" in required), name


@pytest.mark.parametrize("name", sorted(GROUPED))
def test_every_group_estimator_needs_two_responses(name):
    cfg = load_preset("demo_cpu")
    cfg.algorithm.adv_estimator = name
    cfg.actor_rollout_ref.rollout.n = 1
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        check_config(cfg)
    cfg.actor_rollout_ref.rollout.n = 2
    check_config(cfg)
    assert not cfg.use_critic


def test_use_critic_follows_the_registry():
    @register_adv_est("test_valued", needs_critic=True)
    def valued(token_level_rewards, values, response_mask, **kwargs):
        return values * response_mask, values

    try:
        cfg = parse_args(["--preset", "demo_cpu", "--algorithm.adv_estimator", "test_valued"])
        assert cfg.use_critic
        assert not parse_args(["--preset", "demo_cpu", "--algorithm.adv_estimator", "reinforce_plus_plus"]).use_critic
        assert parse_args(["--preset", "demo_cpu", "--algorithm.adv_estimator", "gae"]).use_critic
    finally:
        ADV_ESTIMATORS.pop("test_valued")


def test_policy_loss_required_aggregation_is_checked():
    assert get_policy_loss_spec("gspo").loss_agg_mode == "seq-mean-token-mean"
    assert get_policy_loss_spec("vanilla").loss_agg_mode is None

    @register_policy_loss("test_seq_sum", loss_agg_mode="seq-mean-token-sum")
    def seq_sum(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_log_probs=None):
        zero = torch.zeros(())
        return agg_loss(-advantages * log_prob, response_mask, "seq-mean-token-sum"), zero, zero, zero

    try:
        cfg = load_preset("demo_cpu")
        cfg.actor_rollout_ref.actor.policy_loss.loss_mode = "test_seq_sum"
        cfg.actor_rollout_ref.actor.loss_agg_mode = "token-mean"
        with pytest.raises(ConfigError, match="loss_agg_mode=seq-mean-token-sum"):
            check_config(cfg)
        cfg.actor_rollout_ref.actor.loss_agg_mode = "seq-mean-token-sum"
        check_config(cfg)
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_seq_sum")(lambda *a, **k: None)
        replacement = register_policy_loss("test_seq_sum", replace=True)(lambda *a, **k: None)
        assert POLICY_LOSSES["test_seq_sum"].fn is replacement and POLICY_LOSSES["test_seq_sum"].loss_agg_mode is None
    finally:
        POLICY_LOSSES.pop("test_seq_sum")
    with pytest.raises(ValueError, match="loss_agg_mode='nope' is unknown"):
        register_policy_loss("test_bad", loss_agg_mode="nope")


def test_one_table_for_aggregation_modes_and_kl_estimators():
    assert workers_config.LOSS_AGG_MODES is LOSS_AGG_MODES
    assert workers_config.KL_LOSS_TYPES is KL_ESTIMATORS
    assert list(LOSS_AGG_MODES) == ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                    "seq-mean-token-sum-norm"]
    assert set(KL_ESTIMATORS) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    for name in KL_ESTIMATORS:  # every name of the table is accepted by both config sections
        parse_args(["--preset", "demo_cpu", "--algorithm.kl_penalty", name,
                    "--actor_rollout_ref.actor.kl_loss_type", name])
    with pytest.raises(ValueError, match="algorithm.kl_penalty='k4' is unknown"):
        AlgorithmConfig(kl_penalty="k4")
    with pytest.raises(ValueError, match="actor.loss_agg_mode='token-sum' is unknown"):
        workers_config.ActorConfig(loss_agg_mode="token-sum")
    # aliases share an entry: same values, float64 against the closed forms
    g = torch.Generator().manual_seed(0)
    lp, ref = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    assert torch.equal(kl_penalty(lp, ref, "k1"), lp - ref) and torch.equal(kl_penalty(lp, ref, "kl"), lp - ref)
    torch.testing.assert_close(kl_penalty(lp, ref, "mse"), 0.5 * (lp - ref) ** 2, rtol=0, atol=1e-15)
    r = torch.exp(ref - lp)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), (r - torch.log(r) - 1).clamp(-10, 10), rtol=0, atol=1e-12)
