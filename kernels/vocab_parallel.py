"""Vocabulary-parallel log-probs and entropy (Megatron's vocab-parallel cross entropy).

With the lm_head sharded along the vocabulary over a tensor-parallel group, rank r holds
rows [vocab_start, vocab_start + V_r) of the (V, H) weight and the full hidden states.

    vocab_parallel_log_probs(hidden, weight_shard, labels, vocab_start, tp_group,
                             temperature=1.0, return_entropy=False)

Forward: each rank reduces its own (tokens, V_r) logits, chunked over tokens as in
`linear_logprobs` (so no rank ever holds more than O(chunk x V_r) logits), to a local
log-sum-exp lse_r and entropy ent_r of its shard's softmax, and the label logit where it owns
the label. Two collectives over all tokens then give the global values:

    M = max_r lse_r                                            (all-reduce MAX)
    S = sum_r exp(lse_r - M),  E = sum_r exp(lse_r - M) (ent_r - lse_r),  x_label   (all-reduce SUM)
    lse = M + log S,   log p(label) = x_label - lse,   entropy = lse + E / S

(entropy = -sum_j p_j log p_j = sum_r P_r (ent_r - log P_r) with P_r = exp(lse_r - lse) the
mass of shard r.) Backward: d/dz_j of log p(label) and entropy use the global lse and entropy,
so each rank recomputes its logits chunk and forms its part of the gradient with the same
kernels as the single-device path; the weight-shard gradient stays local and the hidden
gradient is all-reduced over the group (hidden is replicated, as for a column-parallel layer).

Backends: Triton on CUDA tensors (the logits chunk is one matmul in the weight dtype, reduced
by the `logprobs_triton` row kernels), the torch path (vocabulary tiles with an online
log-sum-exp, `linear_logprobs._torch_chunk_forward`) everywhere else and for float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .linear_logprobs import (
    _label_logits,
    _torch_chunk_forward,
    backward_chunks,
    check_args,
    flat_inputs,
)
from .logprobs import compute_dtype, rows_forward


def _local_stats(hidden, weight, labels, inv_temp, with_entropy, chunk, triton_path):
    """(lse_r, ent_r or None, label logit or 0 where not owned), each (tokens,), for this rank's shard."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    cdt = compute_dtype(weight.dtype)
    owned = (labels >= 0) & (labels < vocab)
    safe = torch.where(owned, labels, torch.zeros_like(labels))
    lse = torch.empty(tokens, dtype=cdt, device=hidden.device)
    ent = torch.empty_like(lse) if with_entropy else None
    x_label = torch.empty_like(lse)
    for i in range(0, tokens, chunk):
        sl = slice(i, i + chunk)
        if triton_path:
            logits = hidden[sl] @ weight.T  # (chunk, V_r) in the matmul dtype
            _, c_ent, c_lse = rows_forward(logits, safe[sl], inv_temp, with_entropy, True)
            x_label[sl] = logits.gather(1, safe[sl, None]).squeeze(1).to(cdt) * inv_temp
            del logits
        else:
            _, c_ent, c_lse = _torch_chunk_forward(hidden[sl], weight, safe[sl], inv_temp, with_entropy)
            x_label[sl] = _label_logits(hidden[sl], weight, safe[sl], inv_temp)
        lse[sl] = c_lse
        if with_entropy:
            ent[sl] = c_ent
    return lse, ent, x_label.masked_fill_(~owned, 0.0)


def _combine(lse_r, ent_r, x_label, group):
    """Global (log p(label), entropy or None, lse) from every rank's local statistics."""
    m = lse_r.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(lse_r - m)  # (tokens,) this shard's mass relative to the largest shard's
    parts = [e, x_label] + ([e * (ent_r - lse_r)] if ent_r is not None else [])
    sums = torch.stack(parts)  # (2 or 3, tokens)
    dist.all_reduce(sums, group=group)
    lse = m + torch.log(sums[0])
    ent = lse + sums[2] / sums[0] if ent_r is not None else None
    return sums[1] - lse, ent, lse


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, group, inv_temp, with_entropy, chunk, triton_path):
        lse_r, ent_r, x_label = _local_stats(hidden, weight, labels, inv_temp, with_entropy, chunk, triton_path)
        logp, ent, lse = _combine(lse_r, ent_r, x_label, group)
        ctx.save_for_backward(hidden, weight, labels, lse, ent if with_entropy else lse)
        ctx.group, ctx.inv_temp, ctx.with_entropy = group, inv_temp, with_entropy
        ctx.chunk, ctx.triton_path = chunk, triton_path
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Labels are shard-local: those another rank owns fall outside [0, V_r) and add no label term.
        grad_h, grad_w = backward_chunks(hidden, weight, labels, lse, ent, g_lp, g_ent if ctx.with_entropy else None,
                                         ctx.inv_temp, ctx.chunk, ctx.triton_path, need_h, need_w)
        if need_h:
            dist.all_reduce(grad_h, group=ctx.group)
        return grad_h, grad_w, None, None, None, None, None, None


def vocab_parallel_log_probs(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor,
                             vocab_start: int, tp_group: dist.ProcessGroup | None, temperature: float = 1.0,
                             return_entropy: bool = False, chunk_size: int | None = None, backend: str = "auto"):
    """log softmax(hidden @ W.T / T)[labels] (and entropy) where this rank holds rows
    [vocab_start, vocab_start + V_r) of W; every rank of `tp_group` calls it with the same hidden and labels.

    hidden: (..., H), the same on every rank; weight_shard: (V_r, H); labels: (...) global ids in [0, V).
    Outputs (labels' shape) are float32, or float64 for a float64 weight, identical on every rank;
    differentiable w.r.t. hidden (gradient all-reduced over the group) and weight_shard (local).
    """
    check_args(hidden, weight_shard, labels, temperature, chunk_size, "weight_shard")
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0; got {vocab_start}")
    flat, chunk, triton_path = flat_inputs(hidden, weight_shard, chunk_size, backend)
    shape = labels.shape
    local_labels = labels.reshape(-1).long() - vocab_start
    logp, ent = _VocabParallelLogProbs.apply(flat, weight_shard, local_labels, tp_group, 1.0 / float(temperature),
                                             bool(return_entropy), chunk, triton_path)
    if return_entropy:
        return logp.view(shape), ent.view(shape)
    return logp.view(shape)


def dtensor_log_probs(hidden, weight, labels, temperature: float, return_entropy: bool, chunk_size, backend: str):
    """`linear_log_probs` for a lm_head weight that is a DTensor sharded Shard(0) (vocabulary) on a 1-D mesh.

    hidden may be a DTensor (e.g. sequence-sharded from the final norm): it is made Replicate and
    its local tensor used. Returns plain tensors, the same on every rank of the mesh.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"a DTensor lm_head weight must be sharded along the vocabulary on a 1-D tensor-parallel "
                         f"mesh (placements (Shard(0),)); got mesh {tuple(mesh.shape)} placements "
                         f"{tuple(weight.placements)}. Call linear_log_probs inside the FSDP forward (FSDP "
                         "gathers its own axis), or pass a plain tensor")
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    return vocab_parallel_log_probs(hidden, weight.to_local(), labels, _shard_start(weight), mesh.get_group(),
                                    temperature, return_entropy, chunk_size, backend)


def _shard_start(weight) -> int:
    """First vocabulary row of this rank's Shard(0) block (DTensor's torch.chunk-style split, uneven allowed)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return int(offset[0])
