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


def _row_units(data: DataProto, share_prefix: bool) -> tuple[list[list[int]], list[int]]:
    """The indivisible units of a split and their tokens: rows, or groups of rows sharing a prompt.

    With `share_prefix` a unit is a group whose prompt is packed once (tinyzero.workers.packing),
    and its tokens are the packed ones: the prompt once plus every response.
    """
    mask = data.batch["attention_mask"]
    if not share_prefix:
        return [[i] for i in range(len(data))], [int(x) for x in mask.sum(dim=-1).tolist()]
    from tinyzero.workers.packing import prompt_groups, unit_token_counts

    r = data.batch["responses"].shape[1]
    units = prompt_groups(data.batch["input_ids"], mask, data.batch["position_ids"], r)
    return units, unit_token_counts(mask, r, units)


def _fit_units(units: list[list[int]], tokens: list[int], seqlens: list[int],
               max_token_len: int) -> tuple[list[list[int]], list[int]]:
    """Groups over the token budget are split back into rows (their prompt is then packed per row)."""
    out_units, out_tokens = [], []
    for unit, t in zip(units, tokens):
        if t <= max_token_len or len(unit) == 1:
            out_units.append(unit)
            out_tokens.append(t)
        else:
            out_units += [[i] for i in unit]
            out_tokens += [seqlens[i] for i in unit]
    return out_units, out_tokens


def split_dynamic(data: DataProto, max_token_len: int, group=None,
                  share_prefix: bool = False) -> tuple[list[DataProto], list[list[int]]]:
    """Token-budget micro-batches; returns (micro_batches, row indices of each).

    The count starts at ceil(total_tokens / max_token_len) and grows until the heaviest
    micro-batch fits the budget (or every unit is alone), then is raised to the maximum
    over `group` so all ranks run the same number of passes. Units are rows, or with
    `share_prefix` the groups of rows sharing a prompt, counted by their packed tokens (a
    group over the budget, or more micro-batches than groups, falls back to rows).
    """
    seqlens = data.batch["attention_mask"].sum(dim=-1).tolist()
    n = len(seqlens)
    if max(seqlens) > max_token_len:
        raise ValueError(f"a sequence has {max(seqlens)} tokens but the micro-batch token budget is "
                         f"{max_token_len}; raise ppo_max_token_len_per_gpu / *_max_token_len_per_gpu to at "
                         f"least prompt + response length")
    units, tokens = _fit_units(*_row_units(data, share_prefix), seqlens, max_token_len)
    k = max(1, -(-sum(tokens) // max_token_len))
    k = min(k, len(units))
    parts = balanced_partitions(tokens, k)
    while k < len(units) and max(sum(tokens[i] for i in p) for p in parts) > max_token_len:
        k += 1
        parts = balanced_partitions(tokens, k)
    k_all = _sync_max(k, group)
    if k_all > n:
        raise ValueError(f"rank holds {n} rows but the data-parallel group needs {k_all} micro-batches; "
                         f"give every rank at least {k_all} rows or raise the token budget")
    if k_all > len(units):  # more passes than groups: split by rows
        units, tokens = [[i] for i in range(n)], seqlens
    if k_all != k:
        parts = balanced_partitions(tokens, k_all)
    rows = [sorted(i for u in p for i in units[u]) for p in parts]
    return [data.select_idxs(torch.tensor(r, dtype=torch.long)) for r in rows], rows


def make_micro_batches(data: DataProto, micro_batch_size: int | None, use_dynamic_bsz: bool,
                       max_token_len: int, group=None,
                       packing: str = "none") -> tuple[list[DataProto], list[list[int]] | None]:
    """Fixed or dynamic micro-batches; the index lists are None for fixed (order kept).

    With packing "shared_prefix", token budgets count packed tokens and keep groups whole
    where they fit (fixed micro-batches keep the row order: a group is whole when the size is
    a multiple of rollout.n).
    """
    if use_dynamic_bsz:
        return split_dynamic(data, max_token_len, group, share_prefix=packing == "shared_prefix")
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
