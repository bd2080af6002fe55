"""Configuration of the advantage / KL part of the trainer (`algorithm` in veRL's ppo_trainer.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from .kl import KL_ESTIMATORS

KlControlType = Literal["fixed", "adaptive"]
KL_CONTROL_TYPES = get_args(KlControlType)


@dataclass
class KLControlConfig:
    """Coefficient of the in-reward KL penalty and how it adapts (`algorithm.kl_ctrl`)."""

    type: KlControlType = "fixed"
    """"fixed" keeps kl_coef; "adaptive" steers it toward target_kl (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """Initial (or fixed) coefficient beta of the penalty: reward -= beta * KL."""
    target_kl: float = 0.1
    """Adaptive only: the per-token KL the controller aims for."""
    horizon: int = 10000
    """Adaptive only: samples over which a full proportional correction is applied (must be > 0)."""

    def __post_init__(self):
        if self.type not in KL_CONTROL_TYPES:
            raise ValueError(f"algorithm.kl_ctrl.type={self.type!r} is unknown; use one of {list(KL_CONTROL_TYPES)}")
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef must be >= 0 (got {self.kl_coef})")
        if self.type == "adaptive":
            if self.horizon <= 0:
                raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller "
                                 f"(got {self.horizon})")
            if self.target_kl <= 0:
                raise ValueError(f"algorithm.kl_ctrl.target_kl must be > 0 for the adaptive controller "
                                 f"(got {self.target_kl})")


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (`algorithm.filter_groups`, veRL's names)."""

    enable: bool = False
    """Drop the groups (a prompt's n samples) whose samples all have the same `metric` value, and
    generate further prompt batches until data.train_batch_size prompts are kept."""
    metric: str = "acc"
    """The per-sample value compared within a group: "acc" or "score" (the scorer's, before overlong
    shaping), "seq_reward" (the summed token_level_scores, with the overlong penalty), "seq_final_reward"
    (the summed token_level_rewards: equal to seq_reward, since filtering comes before the log-prob
    passes; so it cannot be used with use_kl_in_reward). New metrics: register_filter_metric."""
    max_num_gen_batches: int = 0
    """The most prompt batches generated for one step; past it the step fails naming this setting.
    0: no limit."""

    def __post_init__(self):
        from .dynamic_sampling import FILTER_METRICS

        if self.metric not in FILTER_METRICS:
            raise ValueError(f"algorithm.filter_groups.metric={self.metric!r} is unknown; use one of "
                             f"{list(FILTER_METRICS)}")
        if self.max_num_gen_batches < 0:
            raise ValueError(f"algorithm.filter_groups.max_num_gen_batches must be >= 0 (0: no limit), got "
                             f"{self.max_num_gen_batches}")


@dataclass
class RolloutCorrectionConfig:
    """veRL's off-policy corrections between the rollout engine's policy and the trainer's
    (`algorithm.rollout_correction`), carried onto tinyzero's settings when the config is built:
    rollout_is="token" is actor_rollout_ref.actor.tis_imp_ratio_cap=rollout_is_threshold,
    rollout_rs="seq_mean_k1" is pipeline.rollout_rs_threshold=rollout_rs_threshold, and bypass_mode=true
    is actor_rollout_ref.rollout.use_rollout_log_probs=true."""

    rollout_is: Literal["token"] | None = None
    """Importance weights min(pi_old / pi_rollout, rollout_is_threshold) per token ("token"); None: off.
    veRL's "sequence" weights are not implemented (use "token")."""
    rollout_is_threshold: float = 2.0
    """Upper bound of the importance weights."""
    rollout_rs: Literal["seq_mean_k1"] | None = None
    """Rejection sampling: mask a response whose geometric-mean ratio leaves [1/threshold, threshold]
    ("seq_mean_k1"; the asynchronous pipeline only); None: off."""
    rollout_rs_threshold: float | None = None
    """Bound of rollout_rs (> 1, e.g. 2.0)."""
    bypass_mode: bool = False
    """The engine's sampling log-probs serve as the PPO old log-probs (two policies instead of three)."""
    loss_type: Literal["ppo_clip"] = "ppo_clip"
    """Bypass mode's loss: the PPO clipped objective (veRL's "reinforce" is not implemented)."""
    rollout_is_batch_normalize: bool = False
    """Must stay false: the importance weights are used as computed (veRL's batch normalisation to mean 1
    is not implemented)."""

    def __post_init__(self):
        if self.rollout_is_batch_normalize:
            raise ValueError("algorithm.rollout_correction.rollout_is_batch_normalize=true is not supported: the "
                             "weights are used as computed; set it to false")
        if self.rollout_is_threshold <= 0:
            raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold must be > 0 "
                             f"(got {self.rollout_is_threshold})")
        if self.rollout_rs is not None and self.rollout_rs_threshold is None:
            raise ValueError(f"algorithm.rollout_correction.rollout_rs={self.rollout_rs} needs rollout_rs_threshold "
                             "(e.g. 2.0)")


@dataclass
class AlgorithmConfig:
    """Advantage estimation and in-reward KL (`algorithm` section)."""

    gamma: float = 1.0
    """Discount factor of GAE and REINFORCE++ (in [0, 1])."""
    lam: float = 1.0
    """GAE lambda (in [0, 1])."""
    adv_estimator: str = "gae"
    """Advantage estimator by registry name: gae, grpo, grpo_passk, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax, opo, gpg (or any name added with register_adv_est). Its registry
    entry decides the rest: gae trains a critic, group estimators need rollout.n >= 2, remax scores a
    greedy baseline rollout per prompt."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group std; False gives Dr. GRPO (mean-centred only)."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL(actor || ref) from the token-level scores before advantages (needs the ref)."""
    kl_penalty: str = "kl"
    """Per-token KL estimator of the in-reward penalty: kl|k1, abs, mse|k2, low_var_kl|k3."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient controller of the in-reward penalty."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (off by default)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """veRL's rollout correction (importance weights, rejection, bypass mode), off by default."""

    def __post_init__(self):
        if isinstance(self.kl_ctrl, dict):
            self.kl_ctrl = KLControlConfig(**self.kl_ctrl)
        if isinstance(self.rollout_correction, dict):
            self.rollout_correction = RolloutCorrectionConfig(**self.rollout_correction)
        if isinstance(self.filter_groups, dict):
            self.filter_groups = FilterGroupsConfig(**self.filter_groups)
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"algorithm.gamma must be in [0, 1] (got {self.gamma})")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"algorithm.lam must be in [0, 1] (got {self.lam})")
        from .advantages import ADV_ESTIMATORS

        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError(f"algorithm.adv_estimator={self.adv_estimator!r} is unknown; use one of "
                             f"{sorted(ADV_ESTIMATORS)} or register one with register_adv_est")
        if self.kl_penalty not in KL_ESTIMATORS:
            raise ValueError(f"algorithm.kl_penalty={self.kl_penalty!r} is unknown; use one of "
                             f"{list(KL_ESTIMATORS)}")
