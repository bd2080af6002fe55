"""Per-group statistics of sequence scores (GRPO, RLOO, REINFORCE++-baseline, OPO).

Groups are the rollouts of one prompt (the `uid` non-tensor column). The torch path uses
`index_add_` (no Python loop over groups) and a two-pass variance in float64; the Triton path
uses atomics in float32 (see scan_triton).

Conventions follow veRL's reference loops: a group of one has mean 0 and std 1 (so its
advantage is the raw score), std is the unbiased (n - 1) estimate, as `torch.std`.
"""

from __future__ import annotations

import numpy as np
import torch

from ._backend import use_triton


def group_ids(index, device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels (uid strings, ints, a tensor) to contiguous ids 0..G-1.

    Returns (ids: LongTensor (n,), G). Labels are compared by value; mixed types fall back to
    their string form.
    """
    if isinstance(index, torch.Tensor):
        labels = index.detach().reshape(-1).cpu().numpy()
    else:
        labels = np.asarray(index, dtype=object).reshape(-1)
    if labels.size == 0:
        return torch.zeros(0, dtype=torch.long, device=device), 0
    try:
        _, inverse = np.unique(labels, return_inverse=True)
    except TypeError:  # unorderable mixture (e.g. str and int)
        _, inverse = np.unique(np.array([str(x) for x in labels], dtype=object), return_inverse=True)
    inverse = torch.from_numpy(inverse.reshape(-1).astype(np.int64))
    return inverse.to(device), int(inverse.max()) + 1


def group_stats(scores: torch.Tensor, ids: torch.Tensor, num_groups: int,
                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, m2) per group: m2 is the sum of squared deviations from the group mean.

    float64 on the torch path, float32 on the Triton path.
    """
    if scores.dim() != 1 or ids.shape != scores.shape:
        raise ValueError(f"scores and ids must be 1-D of one length; got {tuple(scores.shape)} and "
                         f"{tuple(ids.shape)}")
    ids = ids.to(scores.device)
    if use_triton(scores, backend):
        from . import scan_triton

        return scan_triton.group_count_mean_m2(scores.float(), ids, num_groups)
    x = scores.to(torch.float64)
    cnt = torch.zeros(num_groups, dtype=torch.float64, device=x.device).index_add_(0, ids, torch.ones_like(x))
    sums = torch.zeros_like(cnt).index_add_(0, ids, x)
    mean = sums / cnt.clamp_min(1.0)  # (G,)
    m2 = torch.zeros_like(cnt).index_add_(0, ids, (x - mean[ids]).square())
    return cnt, mean, m2


def group_mean_std(scores: torch.Tensor, ids: torch.Tensor, num_groups: int,
                   backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group (mean, std, count) with veRL's singleton rule (mean 0, std 1); float64/float32."""
    cnt, mean, m2 = group_stats(scores, ids, num_groups, backend)
    std = torch.sqrt(m2 / (cnt - 1.0).clamp_min(1.0))
    single = cnt <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean, std, cnt
