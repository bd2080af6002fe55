"""Exact loss scaling under gradient accumulation and data parallelism.

A mini-batch's loss is defined over all of its rows on all data-parallel ranks, e.g. for
"token-mean" sum(loss * mask) / sum(mask) over the whole mini-batch. Each rank runs
several micro-batches and calls `agg_loss` on each, which normalises by the micro-batch's
own count (tokens for token-mean, rows for the seq-mean modes). Multiplying a micro-batch
loss by

    weight = count(micro-batch) / count(mini-batch, all ranks)

turns it into that micro-batch's share of the mini-batch loss, so the shares sum to the
mini-batch loss exactly. FSDP averages gradients over the ranks of its mesh (it divides
the sum by their number), so the backward pass uses weight * dp_size: the averaged
gradient is then the gradient of the mini-batch loss, whatever the split.

Metric shares use the same weights; summing them over micro-batches and all-reducing
(SUM) over ranks gives the mini-batch value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TOKEN_MODES = ("token-mean",)
SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM over `group` (a no-op when not distributed or a group of one)."""
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def global_counts(response_mask: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid tokens, rows) of a mini-batch summed over the data-parallel group, float64 on CPU."""
    counts = torch.tensor([float(response_mask.sum().item()), float(response_mask.shape[0])], dtype=torch.float64)
    all_reduce_sum(counts, group)
    return counts[0], counts[1]


def micro_weight(loss_agg_mode: str, micro_mask: torch.Tensor, global_tokens: torch.Tensor,
                 global_rows: torch.Tensor) -> float:
    """The factor turning agg_loss(micro-batch) into its share of the mini-batch loss."""
    if loss_agg_mode in TOKEN_MODES:
        return float(micro_mask.sum().item()) / max(float(global_tokens), 1.0)
    if loss_agg_mode in SEQ_MODES:
        return float(micro_mask.shape[0]) / max(float(global_rows), 1.0)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; use one of {TOKEN_MODES + SEQ_MODES}")


def token_weight(micro_mask: torch.Tensor, global_tokens: torch.Tensor) -> float:
    """Share of a micro-batch in a token-mean metric (clip fractions, approx. KL)."""
    return float(micro_mask.sum().item()) / max(float(global_tokens), 1.0)
