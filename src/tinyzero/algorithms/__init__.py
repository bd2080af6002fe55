"""The math of the trainer: advantage estimators, KL penalties and controllers, losses.

Names and numerics follow veRL's `verl/trainer/ppo/core_algos.py` and
`verl/utils/torch_functional.py`; estimators and policy losses live in registries
(`register_adv_est`, `register_policy_loss`) so a new one is one decorated function, and each
registry entry carries what the trainer must know about it (an estimator's needs_groups /
needs_critic / needs_baseline, a loss's required aggregation). Aggregation modes
(`LOSS_AGG_MODES`) and KL estimators (`KL_ESTIMATORS`) are one table each.
The heavy lifting (reverse scans, group statistics, log-probs) is in `tinyzero.kernels`.
"""

from .advantages import (
    ADV_ESTIMATORS,
    AdvEstimatorSpec,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_response_mask,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    get_adv_estimator_spec,
    register_adv_est,
)
from .config import AlgorithmConfig, KLControlConfig
from .functional import clip_by_value, masked_mean, masked_sum, masked_var, masked_whiten
from .kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    get_kl_controller,
    kl_penalty,
)
from .losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossSpec,
    agg_loss,
    apply_tis,
    compute_entropy_loss,
    compute_policy_loss,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    compute_value_loss,
    get_policy_loss_fn,
    get_policy_loss_spec,
    register_policy_loss,
)
from .rollout_correction import rollout_mismatch_metrics, tis_weights

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvEstimatorSpec",
    "AlgorithmConfig",
    "FixedKLController",
    "KLControlConfig",
    "PolicyLossSpec",
    "agg_loss",
    "apply_kl_penalty",
    "apply_tis",
    "clip_by_value",
    "compute_advantage",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_kl_loss",
    "compute_opo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_gspo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_response_mask",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "get_adv_estimator_fn",
    "get_adv_estimator_spec",
    "get_kl_controller",
    "get_policy_loss_fn",
    "get_policy_loss_spec",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
    "rollout_mismatch_metrics",
    "tis_weights",
]
