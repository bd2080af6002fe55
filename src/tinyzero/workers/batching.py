"""Micro-batching for forward and training passes: fixed row counts or token budgets.

Fixed: a rank's batch is split into chunks of `micro_batch_size` rows, in order.
Dynamic (`use_dynamic_bsz`): rows are grouped so that every micro-batch holds about the
same number of real tokens (attention_mask sum) and at most `max_token_len` of them when
possible. The number of micro-batches is agreed across the data-parallel group (max over
ranks) because every FSDP forward / backward is a collective: ranks must run the same
number of them. Outputs computed on a rearranged batch are put back in the original row
order with `restore_order`.

`trim_padding` cuts the columns that are padding in every row of a micro-batch (left of
the prompts, right of the responses), so short micro-batches cost less compute; results
for real tokens do not change.
"""

from __future__ import annotations

import heapq

import torch
import torch.distributed as dist

from tinyzero.protocol import DataProto


def split_fixed(data: DataProto, micro_batch_size: int | None) -> list[DataProto]:
    """Chunks of `micro_batch_size` rows in order (the whole batch when None)."""
    if micro_batch_size is None or micro_batch_size >= len(data):
        return [data]
    return data.split(micro_batch_size)


def balanced_partitions(weights: list[int], num_parts: int) -> list[list[int]]:
    """Split item indices into `num_parts` non-empty groups with near-equal weight sums.

    Longest-processing-time greedy: items by decreasing weight go to the lightest group
    (ties broken by the lower group index); each group's indices are returned sorted.
    """
    n = len(weights)
    if not 1 <= num_parts <= n:
        raise ValueError(f"cannot split {n} items into {num_parts} non-empty groups")
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    groups: list[list[int]] = [[] for _ in range(num_parts)]
    # The first num_parts items seed one group each, so no group stays empty.
    heap = []
    for g, i in enumerate(order[:num_parts]):
        groups[g].append(i)
        heap.append((weights[i], g))
    heapq.heapify(heap)
    for i in order[num_parts:]:
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + weights[i], g))
    return [sorted(g) for g in groups]


def _sync_max(value: int, group) -> int:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def split_dynamic(data: DataProto, max_token_len: int, group=None) -> tuple[list[DataProto], list[list[int]]]:
    """Token-budget micro-batches; returns (micro_batches, row indices of each).

    The count starts at ceil(total_tokens / max_token_len) and grows until the heaviest
    micro-batch fits the budget (or every row is alone), then is raised to the maximum
    over `group` so all ranks run the same number of passes.
    """
    seqlens = data.batch["attention_mask"].sum(dim=-1).tolist()
    n = len(seqlens)
    if max(seqlens) > max_token_len:
        raise ValueError(f"a sequence has {max(seqlens)} tokens but the micro-batch token budget is "
                         f"{max_token_len}; raise ppo_max_token_len_per_gpu / *_max_token_len_per_gpu to at "
                         f"least prompt + response length")
    k = max(1, -(-sum(seqlens) // max_token_len))
    k = min(k, n)
    parts = balanced_partitions(seqlens, k)
    while k < n and max(sum(seqlens[i] for i in p) for p in parts) > max_token_len:
        k += 1
        parts = balanced_partitions(seqlens, k)
    k_all = _sync_max(k, group)
    if k_all > n:
        raise ValueError(f"rank holds {n} rows but the data-parallel group needs {k_all} micro-batches; "
                         f"give every rank at least {k_all} rows or raise the token budget")
    if k_all != k:
        parts = balanced_partitions(seqlens, k_all)
    return [data.select_idxs(torch.tensor(p, dtype=torch.long)) for p in parts], parts


def make_micro_batches(data: DataProto, micro_batch_size: int | None, use_dynamic_bsz: bool,
                       max_token_len: int, group=None) -> tuple[list[DataProto], list[list[int]] | None]:
    """Fixed or dynamic micro-batches; the index lists are None for fixed (order kept)."""
    if use_dynamic_bsz:
        return split_dynamic(data, max_token_len, group)
    return split_fixed(data, micro_batch_size), None


def restore_order(outputs: torch.Tensor, parts: list[list[int]] | None) -> torch.Tensor:
    """Rows of `outputs` (micro-batches concatenated) back into the original order."""
    if parts is None:
        return outputs
    flat = torch.tensor([i for p in parts for i in p], dtype=torch.long, device=outputs.device)
    inverse = torch.empty_like(flat)
    inverse[flat] = torch.arange(len(flat), device=outputs.device)
    return outputs[inverse]


def trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 response_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Drop columns that are padding in every row: left of the prompts, right of the responses.

    Returns (input_ids, attention_mask, position_ids, kept_response_length); the kept
    response columns are the first `kept_response_length` of the original responses.
    """
    total = input_ids.shape[1]
    prompt_len = total - response_length
    col_used = attention_mask.bool().any(dim=0)  # (seq,)
    used_prompt = col_used[:prompt_len].nonzero()
    # Keep at least the last prompt column: response position 0 is predicted from it.
    start = int(used_prompt[0]) if len(used_prompt) else prompt_len - 1
    start = min(start, prompt_len - 1)
    used_resp = col_used[prompt_len:].nonzero()
    kept = int(used_resp[-1]) + 1 if len(used_resp) else 1
    end = prompt_len + kept
    return (input_ids[:, start:end], attention_mask[:, start:end],
            position_ids[..., start:end], kept)
