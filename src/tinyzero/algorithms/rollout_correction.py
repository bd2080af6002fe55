"""Rollout / trainer probability mismatch: diagnostics and truncated importance weights.

The rollout engine (vLLM in bf16, the native sampler) samples from probabilities that differ
slightly from the trainer's (FSDP, other kernels). `rollout_mismatch_metrics` reports how far
apart they are (veRL's training/rollout_probs_diff_* and its rollout_corr/* off-policy metrics), and
`tis_weights` gives the truncated importance weights min(pi_train / pi_rollout, cap) that the
policy loss applies when `tis_imp_ratio_cap > 0` (see losses.apply_tis).

TIS follows veRL 0.5 (`actor.tis_imp_ratio_cap`, token level, applied inside the policy loss).
Current veRL moved this to `algorithm.rollout_correction` (token or sequence weights computed on
the driver, optional rejection sampling); the token-level truncated weight is the same quantity.
"""

from __future__ import annotations

import math

import torch

from .functional import masked_mean, masked_sum


def tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                cap: float) -> torch.Tensor:
    """min(exp(old - rollout), cap) on valid tokens, 0 elsewhere; (B, R), no gradient."""
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0 (got {cap}); a cap <= 0 means TIS is off")
    weight = torch.clamp(torch.exp(old_log_probs - rollout_log_probs), max=cap)
    return (weight * response_mask).detach()


SAFETY_BOUND = 20.0
"""Log-ratios are clamped to +-this before exp in the chi-squared metrics (veRL's bound)."""


@torch.no_grad()
def rollout_mismatch_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                             response_mask: torch.Tensor, tis_cap: float | None = None) -> dict[str, torch.Tensor]:
    """Metrics (0-d tensors, float32 or wider) comparing trainer (old) and rollout log-probs, under veRL's names.

    training/rollout_probs_diff_{max,mean,std}: |p_train - p_rollout| per valid token, and
    training/rollout_actor_probs_pearson_corr: the correlation of the two probabilities (veRL's debug metrics);
    training/rollout_log_probs_diff_mean: mean |log p_train - log p_rollout| (tinyzero's);
    rollout_corr/* (veRL's off-policy metrics, masked means over all valid tokens unless per sequence):
    kl = mean(log p_rollout - log p_train); k3_kl = mean(r - log r - 1), r = p_train / p_rollout;
    training_ppl / rollout_ppl = the batch mean of each sequence's exp(-mean token log-prob), and
    training_log_ppl / rollout_log_ppl the mean of the exponent; log_ppl_diff (mean, abs mean, max, min) of the
    per-sequence rollout minus training mean log-prob; ppl_ratio = mean exp(log_ppl_diff); chi2_token =
    mean(r^2) - 1; chi2_seq = mean over sequences of (prod r)^2 - 1 (log-ratios clamped to +-SAFETY_BOUND);
    training/rollout_tis_clip_frac: share of tokens whose ratio exceeds tis_cap (if given, > 0).
    Inputs are (B, R) in any float dtype (bf16 / fp16 from an engine is upcast to float32). Per-sequence means
    divide by (valid tokens + 1e-8), as veRL's masked_mean.
    """
    dtype = torch.promote_types(torch.promote_types(old_log_probs.dtype, rollout_log_probs.dtype), torch.float32)
    old_log_probs, rollout_log_probs = old_log_probs.to(dtype), rollout_log_probs.to(dtype)
    valid = response_mask.bool()
    names = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
             "training/rollout_actor_probs_pearson_corr", "training/rollout_log_probs_diff_mean", "rollout_corr/kl",
             "rollout_corr/k3_kl", "rollout_corr/training_ppl", "rollout_corr/training_log_ppl",
             "rollout_corr/rollout_ppl", "rollout_corr/rollout_log_ppl", "rollout_corr/log_ppl_diff",
             "rollout_corr/log_ppl_abs_diff", "rollout_corr/log_ppl_diff_max", "rollout_corr/log_ppl_diff_min",
             "rollout_corr/ppl_ratio", "rollout_corr/chi2_token", "rollout_corr/chi2_seq")
    if not valid.any():
        return {name: torch.zeros((), device=old_log_probs.device) for name in names}
    p_train, p_rollout = torch.exp(old_log_probs[valid]), torch.exp(rollout_log_probs[valid])  # (valid tokens,)
    diff = torch.abs(p_rollout - p_train)  # (valid tokens,)
    log_ratio = old_log_probs - rollout_log_probs  # (B, R)
    seq_train = masked_mean(old_log_probs, response_mask, axis=-1)  # (B,)
    seq_rollout = masked_mean(rollout_log_probs, response_mask, axis=-1)  # (B,)
    log_ppl_diff = seq_rollout - seq_train  # (B,)
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # (B, R)
    seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B,)
    corr = torch.corrcoef(torch.stack([p_train, p_rollout]))[0, 1] if diff.numel() > 1 else torch.ones(())
    metrics = {
        "training/rollout_probs_diff_max": diff.max(),
        "training/rollout_probs_diff_mean": diff.mean(),
        "training/rollout_probs_diff_std": diff.std() if diff.numel() > 1 else torch.zeros_like(diff.mean()),
        "training/rollout_actor_probs_pearson_corr": corr,
        "training/rollout_log_probs_diff_mean": masked_mean(log_ratio.abs(), response_mask),
        "rollout_corr/kl": masked_mean(-log_ratio, response_mask),
        "rollout_corr/k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask),
        "rollout_corr/training_ppl": torch.exp(-seq_train).mean(),
        "rollout_corr/training_log_ppl": (-seq_train).mean(),
        "rollout_corr/rollout_ppl": torch.exp(-seq_rollout).mean(),
        "rollout_corr/rollout_log_ppl": (-seq_rollout).mean(),
        "rollout_corr/log_ppl_diff": log_ppl_diff.mean(),
        "rollout_corr/log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "rollout_corr/log_ppl_diff_max": log_ppl_diff.max(),
        "rollout_corr/log_ppl_diff_min": log_ppl_diff.min(),
        "rollout_corr/ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "rollout_corr/chi2_token": masked_mean(rho.square(), response_mask) - 1.0,
        "rollout_corr/chi2_seq": torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
    }
    if tis_cap is not None and tis_cap > 0:
        metrics["training/rollout_tis_clip_frac"] = masked_mean((torch.exp(log_ratio) > tis_cap).float(),
                                                                response_mask)
    return metrics


@torch.no_grad()
def seq_mis_keep(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                 threshold: float) -> torch.Tensor:
    """Sequence-level masked importance sampling (veRL's rollout rejection, "seq_mean_k1"): keep a response
    only if its per-token geometric-mean ratio exp(mean_t(old - rollout)) over valid tokens lies in
    [1 / threshold, threshold]. (B, R) inputs; returns (B,) bool (a response without valid tokens is kept)."""
    if threshold <= 1:
        raise ValueError(f"the sequence ratio threshold must be > 1 (got {threshold}); it bounds the ratio to "
                         f"[1/threshold, threshold]")
    mask = response_mask.to(torch.float64)
    log_ratio = (old_log_probs.double() - rollout_log_probs.double()) * mask  # (B, R)
    mean = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    return mean.abs() <= math.log(threshold)
