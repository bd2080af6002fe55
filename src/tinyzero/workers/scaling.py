"""Exact loss scaling under gradient accumulation and data parallelism.

A mini-batch's loss is defined over all of its rows on all data-parallel ranks, e.g. for
"token-mean" sum(loss * mask) / sum(mask) over the whole mini-batch. Each rank runs
several micro-batches and calls `agg_loss` on each, which normalises by the micro-batch's
own count: valid tokens for token-mean, non-empty rows for seq-mean-token-sum and
seq-mean-token-mean. Multiplying a micro-batch loss by

    weight = count(micro-batch) / count(mini-batch, all ranks)

turns it into that micro-batch's share of the mini-batch loss, so the shares sum to the
mini-batch loss exactly. seq-mean-token-sum-norm (Dr. GRPO) has no count in agg_loss
(token sum / response length); its mini-batch loss is taken as the mean over all rows of
that quantity, so the weight is 1 / rows(mini-batch, all ranks). FSDP averages gradients over the ranks of its mesh (it divides
the sum by their number), so the backward pass uses weight * dp_size: the averaged
gradient is then the gradient of the mini-batch loss, whatever the split.

Metric shares use the same weights; summing them over micro-batches and all-reducing
(SUM) over ranks gives the mini-batch value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TOKEN_MODES = ("token-mean",)
SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean")
SUM_MODES = ("seq-mean-token-sum-norm",)


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM over `group` (a no-op when not distributed or a group of one)."""
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _counts(mask: torch.Tensor) -> list[float]:
    """(valid tokens, non-empty rows, rows) of a (rows, R) mask."""
    return [float(mask.sum()), float((mask.sum(-1) > 0).sum()), float(mask.shape[0])]


def global_counts(response_mask: torch.Tensor, group=None) -> torch.Tensor:
    """(valid tokens, non-empty rows, rows) of a mini-batch summed over the group, float64 on CPU."""
    counts = torch.tensor(_counts(response_mask), dtype=torch.float64)
    return all_reduce_sum(counts, group)


def micro_weight(loss_agg_mode: str, micro_mask: torch.Tensor, global_counts: torch.Tensor) -> float:
    """The factor turning agg_loss(micro-batch) into its share of the mini-batch loss."""
    tokens, nonempty, _ = _counts(micro_mask)
    if loss_agg_mode in TOKEN_MODES:
        return tokens / max(float(global_counts[0]), 1.0)
    if loss_agg_mode in SEQ_MODES:
        return nonempty / max(float(global_counts[1]), 1.0)
    if loss_agg_mode in SUM_MODES:
        return 1.0 / max(float(global_counts[2]), 1.0)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; use one of {TOKEN_MODES + SEQ_MODES + SUM_MODES}")


def token_weight(micro_mask: torch.Tensor, global_counts: torch.Tensor) -> float:
    """Share of a micro-batch in a token-mean metric (clip fractions, approx. KL)."""
    return float(micro_mask.sum()) / max(float(global_counts[0]), 1.0)
