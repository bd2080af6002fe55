"""balance_batch: reorder rows so every data-parallel rank gets about the same number of tokens.

DP_COMPUTE_PROTO hands rank d the d-th contiguous chunk of the batch, so after reordering,
chunk d holds partition d. Partitions have equal row counts (chunks must be equal) and are
filled greedily, longest sequence first, into the partition with the fewest tokens that still
has room -- a deterministic function of the lengths, hence the same on every rank.
"""

from __future__ import annotations

import heapq

import torch

from tinyzero.protocol import DataProto


def balanced_equal_partitions(lengths: list[int], num_parts: int) -> list[list[int]]:
    """Split indices into `num_parts` lists of len(lengths)/num_parts indices with near-equal length sums."""
    n = len(lengths)
    if n % num_parts:
        raise ValueError(f"balance_batch: {n} rows cannot be split evenly over {num_parts} ranks")
    size = n // num_parts
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    heap = [(0, p) for p in range(num_parts)]  # (tokens so far, partition)
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in order:
        full = []
        total, p = heapq.heappop(heap)
        while len(parts[p]) >= size:
            full.append((total, p))
            total, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (total + lengths[i], p))
        for item in full:
            heapq.heappush(heap, item)
    return [sorted(p) for p in parts]


def balance_batch(batch: DataProto, dp_size: int, metrics: dict | None = None, group_size: int = 1) -> None:
    """Reorder `batch` in place so its dp_size contiguous chunks carry near-equal token counts.

    With `group_size` > 1, runs of `group_size` consecutive rows (a prompt's samples) move as one,
    so shared-prefix packing finds each group on one rank; when the groups do not split evenly
    over the ranks, rows move one by one.
    """
    if dp_size <= 1:
        return
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    n = len(lengths)
    g = group_size if group_size > 1 and n % group_size == 0 and (n // group_size) % dp_size == 0 else 1
    groups = balanced_equal_partitions([int(sum(lengths[i:i + g])) for i in range(0, n, g)], dp_size)
    parts = [[j * g + k for j in part for k in range(g)] for part in groups]
    batch.reorder(torch.tensor([i for part in parts for i in part]))
    if metrics is not None:
        sums = [sum(lengths[i] for i in part) for part in parts]
        metrics["training/seqlen_balance_max_min_ratio"] = max(sums) / max(min(sums), 1)
