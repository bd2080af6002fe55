"""Configuration of the advantage / KL part of the trainer (`algorithm` in veRL's ppo_trainer.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .kl import KL_ESTIMATORS

KL_CONTROL_TYPES = ("fixed", "adaptive")


@dataclass
class KLControlConfig:
    """Coefficient of the in-reward KL penalty and how it adapts (`algorithm.kl_ctrl`)."""

    type: str = "fixed"
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

    def __post_init__(self):
        if isinstance(self.kl_ctrl, dict):
            self.kl_ctrl = KLControlConfig(**self.kl_ctrl)
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
