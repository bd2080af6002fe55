"""Rollout / trainer probability mismatch: diagnostics and truncated importance weights.

The rollout engine (vLLM in bf16, the native sampler) samples from probabilities that differ
slightly from the trainer's (FSDP, other kernels). `rollout_mismatch_metrics` reports how far
apart they are (veRL's training/rollout_probs_diff_* plus KL estimates between the two), and
`tis_weights` gives the truncated importance weights min(pi_train / pi_rollout, cap) that the
policy loss applies when `tis_imp_ratio_cap > 0` (see losses.apply_tis).

TIS follows veRL 0.5 (`actor.tis_imp_ratio_cap`, token level, applied inside the policy loss).
Current veRL moved this to `algorithm.rollout_correction` (token or sequence weights computed on
the driver, optional rejection sampling); the token-level truncated weight is the same quantity.
"""

from __future__ import annotations

import math

import torch

from .functional import masked_mean


def tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                cap: float) -> torch.Tensor:
    """min(exp(old - rollout), cap) on valid tokens, 0 elsewhere; (B, R), no gradient."""
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0 (got {cap}); a cap <= 0 means TIS is off")
    weight = torch.clamp(torch.exp(old_log_probs - rollout_log_probs), max=cap)
    return (weight * response_mask).detach()


@torch.no_grad()
def rollout_mismatch_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                             response_mask: torch.Tensor, tis_cap: float | None = None) -> dict[str, torch.Tensor]:
    """Metrics (0-d tensors, float32 or wider) comparing trainer (old) and rollout log-probs over valid tokens.

    training/rollout_probs_diff_{max,mean,std}: |p_train - p_rollout| per token (veRL names);
    training/rollout_log_probs_diff_mean: mean |log p_train - log p_rollout|;
    training/rollout_kl: mean of (rollout - train) log-prob (KL(rollout || train) estimate);
    training/rollout_k3_kl: mean of r - log r - 1 with r = p_train / p_rollout;
    training/rollout_tis_clip_frac: share of tokens whose ratio exceeds tis_cap (if given, > 0).
    Inputs are (B, R) in any float dtype (bf16 / fp16 from an engine is upcast to float32).
    """
    dtype = torch.promote_types(torch.promote_types(old_log_probs.dtype, rollout_log_probs.dtype), torch.float32)
    old_log_probs, rollout_log_probs = old_log_probs.to(dtype), rollout_log_probs.to(dtype)
    valid = response_mask.bool()
    names = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
             "training/rollout_log_probs_diff_mean", "training/rollout_kl", "training/rollout_k3_kl")
    if not valid.any():
        return {name: torch.zeros((), device=old_log_probs.device) for name in names}
    diff = torch.abs(torch.exp(rollout_log_probs) - torch.exp(old_log_probs))[valid]  # (valid tokens,)
    log_ratio = old_log_probs - rollout_log_probs  # (B, R)
    metrics = {
        "training/rollout_probs_diff_max": diff.max(),
        "training/rollout_probs_diff_mean": diff.mean(),
        "training/rollout_probs_diff_std": diff.std() if diff.numel() > 1 else torch.zeros_like(diff.mean()),
        "training/rollout_log_probs_diff_mean": masked_mean(log_ratio.abs(), response_mask),
        "training/rollout_kl": masked_mean(-log_ratio, response_mask),
        "training/rollout_k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask),
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
