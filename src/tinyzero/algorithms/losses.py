"""Loss aggregation, policy losses (registered by name), value loss and entropy loss.

Numerics follow veRL's `core_algos.py`. Policy losses share one signature,

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       config=None, rollout_log_probs=None) -> (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)

where `config` is any object with the actor's clip fields (clip_ratio, clip_ratio_low,
clip_ratio_high, clip_ratio_c, tis_imp_ratio_cap; missing ones take veRL's defaults). All
returns are tensors so metrics stay on the device until the worker logs them; this is the
4-tuple veRL 0.5 returned (current veRL returns (loss, dict of floats), which forces a device
sync per micro-batch). A new loss is one decorated function:

    @register_policy_loss("my_loss")          # loss_agg_mode="...": the aggregation it requires
    def my_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                config=None, rollout_log_probs=None): ...

Shape legend: B = batch, R = response_len; every (B, R) tensor is right-padded by response_mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tinyzero.kernels import entropy_from_logits

from .functional import clip_by_value, masked_mean, masked_sum

PolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registry entry: the loss and the aggregation it requires (None: any of LOSS_AGG_MODES).

    A loss that requires an aggregation computes its value with it whatever loss_agg_mode says,
    so the config must name the same mode: the micro-batch weights follow loss_agg_mode.
    """

    name: str
    fn: PolicyLossFn
    loss_agg_mode: str | None = None


POLICY_LOSSES: dict[str, PolicyLossSpec] = {}


def register_policy_loss(name: str, *, loss_agg_mode: str | None = None,
                         replace: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under `name`; `loss_agg_mode` is the aggregation it requires.

    A name is bound once unless `replace` (a loss rebuilt per run with new constants, such as DPO's).
    """
    if loss_agg_mode is not None and loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"register_policy_loss({name!r}): loss_agg_mode={loss_agg_mode!r} is unknown; use one "
                         f"of {list(LOSS_AGG_MODES)}")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if not replace and name in POLICY_LOSSES and POLICY_LOSSES[name].fn is not fn:
            raise ValueError(f"policy loss {name!r} is already registered ({POLICY_LOSSES[name].fn})")
        POLICY_LOSSES[name] = PolicyLossSpec(name, fn, loss_agg_mode)
        return fn

    return decorator


def get_policy_loss_spec(name: str) -> PolicyLossSpec:
    """The registry entry of `name`; ValueError listing the known names otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under `name`; ValueError listing the known names otherwise."""
    return get_policy_loss_spec(name).fn


def _token_mean(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    if batch_num_tokens is None:
        batch_num_tokens = loss_mask.sum()
    return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size


def _seq_mean_token_sum(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # (B,)
    seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # empty sequences do not count
    if global_batch_size is None:
        global_batch_size = seq_mask.sum()
    return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size


def _seq_mean_token_mean(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    seq_tokens = torch.sum(loss_mask, dim=-1)  # (B,)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_tokens + 1e-8)
    seq_mask = (seq_tokens > 0).float()
    if global_batch_size is None:
        global_batch_size = seq_mask.sum()
    return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size


def _seq_mean_token_sum_norm(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # (B,)
    if loss_scale_factor is None:
        loss_scale_factor = loss_mask.shape[-1]
    return torch.sum(seq_losses) / loss_scale_factor


# The aggregation modes: the one table every config check and loss reads (the order is veRL's).
LOSS_AGG_MODES: dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
             batch_num_tokens: float | torch.Tensor | None = None, global_batch_size: float | torch.Tensor | None = None,
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Aggregate a (B, R) loss matrix into a scalar.

    token-mean: sum over valid tokens / number of valid tokens (batch_num_tokens if given).
    seq-mean-token-sum: mean over non-empty sequences of the per-sequence token sum.
    seq-mean-token-mean: mean over non-empty sequences of the per-sequence token mean.
    seq-mean-token-sum-norm: sum of per-sequence token sums / loss_scale_factor (default R), Dr. GRPO.
    dp_size, batch_num_tokens and global_batch_size make the micro-batch loss a share of a
    global-batch loss (veRL's convention); the defaults give the plain local aggregate.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is unknown; use one of {list(LOSS_AGG_MODES)}")
    return LOSS_AGG_MODES[loss_agg_mode](loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size,
                                         loss_scale_factor)


def _clip_params(config: Any) -> tuple[float, float, float]:
    clip_ratio = getattr(config, "clip_ratio", 0.2) if config is not None else 0.2
    low = getattr(config, "clip_ratio_low", None) if config is not None else None
    high = getattr(config, "clip_ratio_high", None) if config is not None else None
    return (clip_ratio if low is None else low), (clip_ratio if high is None else high), clip_ratio


def _ppo_clip_losses(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high,
                     clip_ratio_c):
    """Token losses of dual-clip PPO and its statistics (veRL's compute_policy_loss_vanilla body)."""
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO (got {clip_ratio_c})")
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # (B, R)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)  # (B, R)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)  # (B, R)
    return pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def apply_tis(pg_losses: torch.Tensor, old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor | None,
              cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025): weight by min(exp(old - rollout), cap).

    Corrects for the rollout engine sampling from slightly different probabilities than the
    trainer computes; off when cap <= 0 or rollout log-probs are absent. The weight carries
    no gradient (old and rollout log-probs are constants of the update).
    """
    if cap <= 0 or rollout_log_probs is None:
        return pg_losses
    weight = torch.clamp(torch.exp(old_log_prob - rollout_log_probs), max=cap).detach()  # (B, R)
    return pg_losses * weight


def _tis_cap(config: Any) -> float:
    """The actor's tis_imp_ratio_cap (<= 0: TIS off, the default without a config)."""
    return getattr(config, "tis_imp_ratio_cap", -1.0) if config is not None else -1.0


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_log_probs=None):
    """PPO clipped surrogate with dual clip (clip_ratio_c) and decoupled clip_ratio_low / _high (DAPO)."""
    low, high, _ = _clip_params(config)
    clip_ratio_c = getattr(config, "clip_ratio_c", 3.0) if config is not None else 3.0
    pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _ppo_clip_losses(
        old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c)
    pg_losses = apply_tis(pg_losses, old_log_prob, rollout_log_probs, _tis_cap(config))
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss("gspo", loss_agg_mode="seq-mean-token-mean")
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask,
                             loss_agg_mode="seq-mean-token-mean", config=None, rollout_log_probs=None):
    """GSPO (Zheng et al. 2025): clip the length-normalised sequence ratio; seq-mean-token-mean always.

    Token ratio s_t = sg[s_seq] * pi / sg[pi], so the gradient flows per token while the value
    is the sequence ratio exp(mean_t(log pi - log pi_old)); log ratio clamped at 10.
    """
    del loss_agg_mode  # GSPO aggregates at the sequence level, as in veRL
    low, high, _ = _clip_params(config)
    negative_approx_kl = log_prob - old_log_prob  # (B, R)
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths  # (B,)
    log_seq_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))  # (B, R)
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_losses = apply_tis(pg_losses, old_log_prob, rollout_log_probs, _tis_cap(config))
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros((), device=pg_loss.device)


def _policy_loss_param(config: Any, name: str, default: float) -> float:
    """config.policy_loss.<name> (the actor config's policy_loss section), else veRL's default."""
    value = getattr(getattr(config, "policy_loss", None), name, None)
    return default if value is None else float(value)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            config=None, rollout_log_probs=None):
    """GPG (Chu et al. 2025): plain policy gradient -log_prob * A, no ratio and no clip (use it with the
    "gpg" advantage estimator and ppo_epochs=1). ppo_kl is reported as a diagnostic only."""
    pg_losses = -log_prob * advantages  # (B, R)
    pg_losses = apply_tis(pg_losses, old_log_prob, rollout_log_probs, _tis_cap(config))
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    zero = torch.zeros((), device=pg_loss.device)
    return pg_loss, zero, masked_mean(old_log_prob - log_prob.detach(), response_mask), zero


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                              config=None, rollout_log_probs=None):
    """CISPO (MiniMax-M1, 2025): -sg(clip(ratio, 1 - low, 1 + high)) * A * log_prob. The importance weight
    is clipped and carries no gradient, so every token keeps a gradient (PPO's clip drops clipped
    tokens' gradients altogether). pg_clipfrac is the share of tokens whose weight was clipped."""
    low, high, _ = _clip_params(config)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # (B, R)
    ratio = torch.exp(negative_approx_kl)
    weight = torch.clamp(ratio, 1 - low, 1 + high).detach()
    pg_losses = -weight * advantages * log_prob
    pg_losses = apply_tis(pg_losses, old_log_prob, rollout_log_probs, _tis_cap(config))
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    pg_clipfrac = masked_mean((ratio != weight).float(), response_mask)
    ppo_kl = masked_mean(-negative_approx_kl.detach(), response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros((), device=pg_loss.device)


def _centred_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor):
    """(A - mean A) * (log pi - mean log pi) per token, means over the valid tokens (B, R); no gradient."""
    adv = advantages.detach()
    logp = log_prob.detach()
    return (adv - masked_mean(adv, response_mask)) * (logp - masked_mean(logp, response_mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, rollout_log_probs=None):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"): the PPO clipped
    surrogate, plus a random clip_cov_ratio share of the micro-batch's tokens whose centred
    advantage x log-prob covariance lies in (clip_cov_lb, clip_cov_ub) -- among those the ratio clip
    left alone -- get no gradient (their loss is multiplied by 0), which slows entropy collapse.
    pg_clipfrac is the share of tokens cut that way. Selection uses torch's global RNG (seeded)."""
    low, high, _ = _clip_params(config)
    ratio_share = _policy_loss_param(config, "clip_cov_ratio", 0.0002)
    lb = _policy_loss_param(config, "clip_cov_lb", 1.0)
    ub = _policy_loss_param(config, "clip_cov_ub", 5.0)
    mask = response_mask > 0  # (B, R)
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clipped = (pg_losses2 > pg_losses1) & mask
    cov = _centred_covariance(advantages, log_prob, response_mask)
    candidates = torch.nonzero((cov > lb) & (cov < ub) & mask & ~clipped)  # (n, 2)
    num_cut = min(max(int(ratio_share * int(mask.sum())), 1), candidates.shape[0])
    keep = torch.ones_like(pg_losses1)
    if num_cut:
        chosen = candidates[torch.randperm(candidates.shape[0])[:num_cut].to(candidates.device)]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * keep
    pg_losses = apply_tis(pg_losses, old_log_prob, rollout_log_probs, _tis_cap(config))
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    pg_clipfrac = masked_mean((keep == 0).float(), response_mask)
    ppo_kl = masked_mean(-negative_approx_kl.detach(), response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros((), device=pg_loss.device)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                               config=None, rollout_log_probs=None):
    """KL-Cov (Cui et al. 2025): the unclipped surrogate -A * ratio, plus ppo_kl_coef * |log pi - log pi_old|
    on the kl_cov_ratio share of the micro-batch's tokens with the largest centred advantage x log-prob
    covariance (at least one). ppo_kl reports the mean |log ratio|, as in veRL."""
    ratio_share = _policy_loss_param(config, "kl_cov_ratio", 0.0002)
    coef = _policy_loss_param(config, "ppo_kl_coef", 1.0)
    mask = response_mask > 0  # (B, R)
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    pg_losses = -advantages * torch.exp(negative_approx_kl)  # (B, R)
    valid = torch.nonzero(mask.reshape(-1)).squeeze(-1)  # (n,) flat positions of the valid tokens
    cov = _centred_covariance(advantages, log_prob, response_mask).reshape(-1)[valid]
    num_penalised = max(1, int(valid.numel() * ratio_share)) if valid.numel() else 0
    penalty = torch.zeros(pg_losses.numel(), dtype=pg_losses.dtype, device=pg_losses.device)
    if num_penalised:
        penalty[valid[torch.topk(cov, num_penalised).indices]] = coef
    pg_losses = pg_losses + penalty.view_as(pg_losses) * abs_kl
    pg_losses = apply_tis(pg_losses, old_log_prob, rollout_log_probs, _tis_cap(config))
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    zero = torch.zeros((), device=pg_loss.device)
    return pg_loss, zero, masked_mean(abs_kl.detach(), response_mask), zero


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange, cliprange_low=None,
                        cliprange_high=None, clip_ratio_c=3.0, loss_agg_mode="token-mean"):
    """Dual-clip PPO loss with explicit clip ranges -> (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)."""
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _ppo_clip_losses(
        old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c)
    return agg_loss(pg_losses, response_mask, loss_agg_mode), pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean"):
    """Clipped value loss: 0.5 * agg(max((v - R)^2, (clip(v, v_old +- eps) - R)^2)) -> (vf_loss, vf_clipfrac)."""
    vpredclipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)  # (B, R)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(clipped_vf_losses, response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"):
    """Mean entropy of softmax(logits) (B, R, V) over the response, aggregated like the losses."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
