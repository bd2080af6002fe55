"""KL estimators, KL-coefficient controllers, in-reward KL and the KL loss term.

Per-token estimators of KL(pi || pi_ref) from log-probs of the sampled tokens
(Schulman, "Approximating KL divergence", 2020), as veRL defines them:

    kl  | k1:          logprob - ref_logprob
    abs:               |logprob - ref_logprob|
    mse | k2:          0.5 * (logprob - ref_logprob)^2
    low_var_kl | k3:   r - log r - 1 with log r = ref_logprob - logprob clamped to [-20, 20],
                       the result clamped to [-10, 10]

A trailing "+" (e.g. "k3+") keeps the forward value but takes the gradient of k2
(straight-through), as veRL does. "full" needs whole-vocabulary log-probs and is refused.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .functional import masked_mean


def _k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


def _abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


def _k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # clamp for numerical stability
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)


# The KL estimators by name (aliases share an entry): the one table every config check reads.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": _k1, "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3,
}


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "full":
        raise ValueError("kl_penalty 'full' needs log-probs over the whole vocabulary, which the trainer does "
                         "not keep; use one of " + ", ".join(KL_ESTIMATORS))
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_penalty {kind!r}; use one of {list(KL_ESTIMATORS)} (optionally with '+')")
    return KL_ESTIMATORS[kind](logprob, ref_logprob)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate (same shape as the inputs); see the module docstring for the kinds."""
    forward = _kl_forward(logprob, ref_logprob, kl_penalty.rstrip("+"))
    if not kl_penalty.endswith("+") or KL_ESTIMATORS[kl_penalty.rstrip("+")] is _k2:
        return forward
    backward = _k2(logprob, ref_logprob)
    return backward - backward.detach() + forward.detach()


class FixedKLController:
    """Constant KL coefficient (`value`)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593).

    value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def get_kl_controller(kl_ctrl: Any):
    """Controller for a KLControlConfig-like object (type, kl_coef, target_kl, horizon)."""
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_coef=kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        if kl_ctrl.horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive controller (got {kl_ctrl.horizon})")
        return AdaptiveKLController(init_kl_coef=kl_ctrl.kl_coef, target_kl=kl_ctrl.target_kl, horizon=kl_ctrl.horizon)
    raise ValueError(f"kl_ctrl.type={kl_ctrl.type!r} is unknown; use 'fixed' or 'adaptive'")


def apply_kl_penalty(data, kl_ctrl, kl_penalty: str = "kl"):
    """In-reward KL: token_level_rewards = token_level_scores - beta * KL(old || ref) * mask.

    Reads `old_log_probs`, `ref_log_prob`, `token_level_scores`, `response_mask`; writes
    `token_level_rewards`; updates the controller with the batch-mean of the per-sequence
    mean KL. Returns (data, metrics) with actor/reward_kl_penalty and
    actor/reward_kl_penalty_coeff (the coefficient used for this batch).
    """
    batch = data.batch
    for key in ("old_log_probs", "ref_log_prob", "token_level_scores", "response_mask"):
        if key not in batch:
            raise ValueError(f"apply_kl_penalty: batch lacks {key!r} (use_kl_in_reward needs the reference policy "
                             f"log-probs and the actor's old_log_probs)")
    response_mask = batch["response_mask"]
    kld = _kl_forward(batch["old_log_probs"], batch["ref_log_prob"], kl_penalty.rstrip("+")) * response_mask
    beta = kl_ctrl.value
    batch["token_level_rewards"] = batch["token_level_scores"] - beta * kld  # (B, R)
    current_kl = torch.mean(masked_mean(kld, mask=response_mask, axis=-1), dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=int(response_mask.shape[0]))
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
                    kl_loss_type: str = "low_var_kl", loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """KL(actor || ref) as a loss term (GRPO's use_kl_loss), aggregated like the policy loss."""
    from .losses import agg_loss

    return agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode)
