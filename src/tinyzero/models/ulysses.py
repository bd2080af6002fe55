"""Ulysses sequence parallelism for HF decoder models (Llama, Qwen2, Qwen3), in pure PyTorch.

The `sp` ranks of a sequence-parallel group hold the same samples and split their sequence:
rank r computes embeddings, MLPs, norms and projections for positions [r*l, (r+1)*l) of every
row only (l = padded length / sp). Attention needs every position, so around it an all-to-all
trades the sequence split for a head split: q/k/v (batch, heads, l, head_dim) on each rank
become (batch, heads/sp, sp*l, head_dim), attention runs over the full sequence with the
rank's heads, and a second all-to-all brings the output back to (batch, heads, l, head_dim).
Activation memory outside attention thus drops by sp; inside it, by sp as well (heads).

How a caller runs a model under sequence parallelism:

    model.set_attn_implementation(ULYSSES_ATTENTION)         # "ulysses_sdpa"; once, at build time
    split = split_for_sp(input_ids, attention_mask, position_ids, sp_group)
    out = backbone(**split.model_kwargs())                   # every rank of the group calls it
    hidden = gather_from_sp(out.last_hidden_state, sp_group, split.pad)   # only if all of it is needed

The workers' paths in one call each: `attach_sp_log_prob_method(model, sp_group)` is the drop-in for
tinyzero.workers.forward.attach_log_prob_method (then `response_log_probs` runs unchanged, padded or
packed), and `sp_model_forward(model, ids, mask, pos, sp_group)` stands for `model(...)` where a
small output is needed whole (critic values, reward scores).

`split_for_sp` pads the sequence to a multiple of sp, keeps this rank's slice of the ids and
position ids (RoPE then sees the true positions), and builds the FULL-sequence attention
mask: HF would otherwise build a mask for the local slice. The mask is a boolean 4-D
(batch, 1, S, S) tensor, which HF passes to attention unchanged; when every row's real tokens
are a prefix with positions 0.. (no left or inner padding) no mask is needed and attention
is plain causal (no S x S tensor). A 2-D padding mask or a 4-D packed mask
(tinyzero.workers.packing, "remove_padding" / "shared_prefix") are both accepted. Memory: a
mask is (batch, S, S) booleans on EVERY rank of the group (attention sees all queries after
the all-to-all), so it does not shrink with sp; for long rows prefer unpadded inputs.

The process group reaches the attention as a forward keyword (`sp_group`) that HF hands down
to every attention call, not as global state: activation checkpointing recomputes the layers
during backward, after any context manager would have exited, and a model kept on
"ulysses_sdpa" behaves exactly as "sdpa" whenever no group is passed (generation, or sp = 1).

Grouped-query attention: the kv heads are split over the ranks as the query heads are. When
sp does not divide the kv heads, each kv head is repeated sp / gcd(kv_heads, sp) times first
(so 2 kv heads at sp=4 become 4), which keeps every query head paired with its own kv head;
the query heads must be divisible by sp.

Attention kernel after the all-to-all: flash-attn (`flash_attn_func`, causal, or
`flash_attn_varlen_func` when the caller passes HF's `cu_seq_lens_q`/`max_length_q` for one
packed row) on CUDA in fp16/bf16 when the package is installed and no 4-D mask is needed;
otherwise torch SDPA with the mask. The flash-attn branch is untested here (no GPU).

Log-probs and the loss scaling convention: `sp_linear_log_probs` lets each rank compute the
log-probs (and entropy) of the labels its own positions predict, then all-gathers the pieces
into the full result, identical on every rank. Its backward hands each rank only the gradient
of its own pieces. If every rank of the group computes the same loss from the gathered
result and calls backward, the parameter gradients on the ranks are partial: their SUM over
the sp group is the gradient of that loss (each token counted once). FSDP averages over its
`fsdp_size` ranks, which include the sp ranks, so a loss scaled for data parallelism by
`weight x dp_size` (tinyzero.workers.scaling) must be scaled by `weight x dp_size x sp`
(= weight x fsdp_size) under sequence parallelism. `gather_from_sp` follows the same rule.
The labels are built from the FULL ids before slicing (the shift crosses slice boundaries).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ULYSSES_ATTENTION = "ulysses_sdpa"


def sp_world(group) -> int:
    """Ranks in a sequence-parallel group (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> None:
    """Raise ValueError unless `sp` divides the query heads (kv heads are repeated when needed)."""
    if num_heads % sp:
        raise ValueError(f"ulysses_sequence_parallel_size={sp} must divide the model's "
                         f"{num_heads} attention heads; set it to a divisor of {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} kv heads")


# ---------------------------------------------------------------------------------------- collectives
def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk i of `x` along scatter_dim goes to rank i; the received chunks are joined along gather_dim."""
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, dim=scatter_dim))  # (n, ...) contiguous
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all; the backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(batch, heads, local_seq, d) on each rank -> (batch, heads / sp, full_seq, d); differentiable."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(batch, heads / sp, full_seq, d) -> (batch, heads, local_seq, d); the inverse of seq_to_heads."""
    return _AllToAll.apply(x, group, 2, 1)


class _GatherPieces(torch.autograd.Function):
    """Join every rank's piece along `dim` (sizes known to all ranks); backward keeps this rank's part.

    The backward does not sum the gradient over the ranks: every rank computes the same function
    of the joined result, so each position's gradient is already whole on every rank, and only the
    rank that produced a piece may pass it on (otherwise it would count sp times).
    """

    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        rank = dist.get_rank(group)
        ctx.dim, ctx.start, ctx.size = dim, sum(sizes[:rank]), sizes[rank]
        longest = max(sizes)
        if x.shape[dim] < longest:
            pad = [0, 0] * (x.dim() - 1 - dim) + [0, longest - x.shape[dim]]
            x = F.pad(x, pad)
        bufs = [torch.empty_like(x) for _ in sizes]
        dist.all_gather(bufs, x.contiguous(), group=group)
        return torch.cat([b.narrow(dim, 0, s) for b, s in zip(bufs, sizes)], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.start, ctx.size).contiguous(), None, None, None


def gather_from_sp(t: torch.Tensor, group, pad: int = 0, dim: int = 1) -> torch.Tensor:
    """All-gather the ranks' sequence slices of `t` along `dim` and drop the last `pad` positions.

    Differentiable; the backward passes this rank's slice of the gradient (see the module
    docstring for the loss scaling this implies).
    """
    if sp_world(group) == 1:
        return t if pad == 0 else t.narrow(dim, 0, t.shape[dim] - pad)
    full = _GatherPieces.apply(t, group, dim, [t.shape[dim]] * sp_world(group))
    return full if pad == 0 else full.narrow(dim, 0, full.shape[dim] - pad)


# ---------------------------------------------------------------------------------------- inputs
@dataclass
class SPInputs:
    """One rank's share of a micro-batch under sequence parallelism (see `split_for_sp`)."""

    input_ids: torch.Tensor  # (batch, local_len) this rank's slice
    position_ids: torch.Tensor  # (batch, local_len) true positions of the slice
    attention_mask: torch.Tensor | None  # (batch, 1, padded_len, padded_len) bool, None = causal
    group: object  # the sp process group
    seq_len: int  # sequence length before padding
    pad: int  # positions appended to reach a multiple of sp

    @property
    def padded_len(self) -> int:
        return self.seq_len + self.pad

    def model_kwargs(self) -> dict:
        """Keyword arguments for the HF model (or its backbone) forward on this rank."""
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask, position_ids=self.position_ids,
                    use_cache=False, sp_group=self.group)


def _prefix_only(valid: torch.Tensor, position_ids: torch.Tensor) -> bool:
    """True when every row's real tokens come first, at positions 0, 1, ...: causal attention then
    gives them exactly what the padding mask would."""
    cols = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    prefix = bool((valid == (cols < valid.sum(-1, keepdim=True))).all())
    return prefix and bool((position_ids[valid] == cols[valid]).all())


def full_mask(attention_mask: torch.Tensor, padded_len: int) -> torch.Tensor:
    """(batch, 1, padded_len, padded_len) bool, True = may attend, from a 2-D (batch, seq) padding
    mask or a 4-D boolean mask (batch, 1, seq, seq). A query sees the earlier real tokens of its row
    (2-D) or what the 4-D mask allows; appended positions see themselves only, so no softmax row
    is empty."""
    b, s = attention_mask.shape[0], attention_mask.shape[-1]
    device = attention_mask.device
    pos = torch.arange(padded_len, device=device)
    diagonal = pos[None, :] == pos[:, None]  # (S, S)
    if attention_mask.dim() == 2:
        valid = F.pad(attention_mask.bool(), (0, padded_len - s))  # (batch, S)
        causal = pos[None, :] <= pos[:, None]
        return ((causal & valid[:, None, :]) | diagonal)[:, None]
    if attention_mask.dtype != torch.bool or attention_mask.shape[1] != 1 or attention_mask.shape[2] != s:
        raise ValueError(f"a 4-D attention mask under sequence parallelism must be boolean (batch, 1, seq, seq), "
                         f"True = may attend (the SDPA form of tinyzero.workers.packing.model_mask); got "
                         f"{attention_mask.dtype} {tuple(attention_mask.shape)}")
    out = diagonal.expand(b, 1, padded_len, padded_len).clone()
    out[:, :, :s, :s] = attention_mask
    return out


def split_for_sp(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                 group) -> SPInputs:
    """This rank's slice of a micro-batch, plus the full-sequence mask its attention needs.

    `attention_mask`: (batch, seq) padding mask, a boolean (batch, 1, seq, seq) mask, or None
    (causal). The sequence is padded on the right to a multiple of sp (pad id 0, position 0;
    the appended positions see only themselves and nothing real sees them).
    """
    if position_ids.dim() != 2 or position_ids.shape != input_ids.shape:
        raise ValueError(f"sequence parallelism needs (batch, seq) position_ids matching input_ids "
                         f"{tuple(input_ids.shape)}; got {tuple(position_ids.shape)} (multi-section mrope "
                         f"positions are not supported: set ulysses_sequence_parallel_size=1)")
    sp, rank = sp_world(group), (dist.get_rank(group) if group is not None else 0)
    b, s = input_ids.shape
    padded = math.ceil(s / sp) * sp
    pad, local = padded - s, padded // sp
    mask = None
    if attention_mask is not None:
        causal_ok = attention_mask.dim() == 2 and _prefix_only(attention_mask.bool(), position_ids)
        mask = None if causal_ok else full_mask(attention_mask, padded)
    ids = F.pad(input_ids, (0, pad))
    if mask is None:  # consecutive positions, so HF's own mask logic also finds plain causal attention
        pos = torch.arange(padded, device=input_ids.device, dtype=position_ids.dtype).expand(b, -1)
    else:
        pos = F.pad(position_ids, (0, pad))
    cut = slice(rank * local, (rank + 1) * local)
    return SPInputs(input_ids=ids[:, cut], position_ids=pos[:, cut].contiguous(), attention_mask=mask,
                    group=group, seq_len=s, pad=pad)


# ---------------------------------------------------------------------------------------- attention
def _flash_usable(q: torch.Tensor, mask) -> bool:
    return (mask is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("flash_attn") is not None)


def _flash(q, k, v, scaling, dropout, kwargs):
    """flash-attn on (batch, heads, S, d) inputs: varlen for one packed row with HF's cu_seq_lens, else causal."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, S, heads, d)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if q.shape[0] != 1:
            raise ValueError("cu_seq_lens_q under sequence parallelism needs one packed row (batch 1)")
        longest = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, longest, longest, dropout_p=dropout,
                                     softmax_scale=scaling, causal=True)[None]
    else:
        out = flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scaling, causal=True)
    return out.transpose(1, 2)  # (batch, heads, S, d)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, sp_group=None, **kwargs):
    """HF attention interface: (batch, heads, local_seq, d) q/k/v in, (batch, local_seq, heads, d) out.

    Without `sp_group` (or with a group of one) it is HF's SDPA attention unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sp_world(sp_group) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    sp = sp_world(sp_group)
    if sliding_window is not None:
        raise ValueError("sliding-window attention layers are not supported under sequence parallelism; "
                         "set ulysses_sequence_parallel_size=1 or use_sliding_window=False")
    if kwargs.get("past_key_values") is not None:
        raise ValueError("a KV cache is not supported under sequence parallelism; call the model with use_cache=False")
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, kv_heads, sp)
    repeat = sp // math.gcd(kv_heads, sp)
    if repeat > 1:  # kv heads that sp does not divide: repeat each (its query heads stay paired with it)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    full = query.shape[2] * sp
    if attention_mask is not None and attention_mask.shape[-1] != full:
        raise ValueError(f"attention under sequence parallelism needs the full-sequence mask "
                         f"(..., {full}, {full}); got {tuple(attention_mask.shape)}. Build the model inputs with "
                         f"tinyzero.models.ulysses.split_for_sp and pass split.model_kwargs()")
    q, k, v = (seq_to_heads(t, sp_group) for t in (query, key, value))  # (batch, heads / sp, S, d)
    if _flash_usable(q, attention_mask) and kwargs.get("is_causal", getattr(module, "is_causal", True)):
        out = _flash(q, k, v, scaling, dropout, kwargs)
    else:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        causal = attention_mask is None and kwargs.get("is_causal", getattr(module, "is_causal", True))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                             is_causal=causal)
    out = heads_to_seq(out, sp_group)  # (batch, heads, local_seq, d)
    return out.transpose(1, 2).contiguous(), None


def register_ulysses_attention() -> str:
    """Register "ulysses_sdpa" with HF's attention and mask registries (idempotent); return the name.

    Its mask creation is SDPA's: under sequence parallelism the caller passes the full 4-D mask
    (used as-is) or none, so HF never builds one for a local slice.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ULYSSES_ATTENTION, sdpa_mask)
    return ULYSSES_ATTENTION


register_ulysses_attention()


# ---------------------------------------------------------------------------------------- log-probs
def sp_linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, labels: torch.Tensor,
                        group, temperature: float = 1.0, return_entropy: bool = False):
    """Log-probs (and entropy) at chosen positions of a sequence split over the sp group, gathered.

    hidden: (batch, local_len, hidden) this rank's final hidden states; index: (N,) positions in
    the flattened FULL padded sequence (batch * local_len * sp) whose hidden state predicts
    labels: (N,) token ids (taken from the full ids). Each rank computes the entries it holds;
    the result (N,) fp32 (each of log-probs, entropy) is the same on every rank, in `index` order.
    """
    from tinyzero.kernels import linear_log_probs

    sp, rank = sp_world(group), (dist.get_rank(group) if group is not None else 0)
    local = hidden.shape[1]
    full = local * sp
    row, col = index // full, index % full
    owner = col // local
    picks = [(owner == r).nonzero().squeeze(-1) for r in range(sp)]  # entries each rank holds, in order
    mine = picks[rank]
    flat = hidden.reshape(-1, hidden.shape[-1])
    h = flat.index_select(0, row[mine] * local + col[mine] % local)  # (n_rank, hidden)
    out = linear_log_probs(h, weight, labels[mine], temperature=temperature, return_entropy=return_entropy)
    out = out if return_entropy else (out,)
    if sp > 1:
        sizes = [len(p) for p in picks]
        order = torch.cat(picks)
        gathered = []
        for t in out:
            joined = _GatherPieces.apply(t, group, 0, sizes)  # rank order
            gathered.append(joined.new_zeros(joined.shape).index_copy(0, order, joined))
        out = tuple(gathered)
    return out if return_entropy else out[0]


def _backbone(model: nn.Module) -> nn.Module:
    return getattr(model, getattr(model, "base_model_prefix", "model"))


def sp_token_log_probs(self, input_ids, attention_mask, position_ids, responses, temperature=1.0,
                       return_entropy=False, packed=None, *, sp_group=None):
    """`tinyzero.workers.forward._token_log_probs` under sequence parallelism: same arguments, results.

    The inputs are the FULL micro-batch (identical on the ranks of `sp_group`): a (batch, seq)
    padding mask with responses as the last columns, or packed rows with their boolean 4-D mask and
    `packed` (hidden_index / valid / scatter). Results are (batch, R) fp32 on every rank; see the
    module docstring for the gradient convention.
    """
    split = split_for_sp(input_ids, attention_mask, position_ids, sp_group)
    hidden = _backbone(self)(**split.model_kwargs()).last_hidden_state  # (batch, local_len, hidden)
    weight = self.get_output_embeddings().weight  # (vocab, hidden)
    b, s = input_ids.shape
    if packed is None:
        r = responses.shape[1]
        cols = torch.arange(s - r - 1, s - 1, device=input_ids.device)
        index = (torch.arange(b, device=input_ids.device)[:, None] * split.padded_len + cols).reshape(-1)
        labels = responses.reshape(-1)
    else:
        hi = packed.hidden_index
        index = hi // s * split.padded_len + hi % s
        labels = responses[packed.valid]
    out = sp_linear_log_probs(hidden, weight, index, labels, sp_group, temperature, return_entropy)
    out = out if return_entropy else (out,)
    out = tuple(t.reshape(b, -1) if packed is None else packed.scatter(t) for t in out)
    return out if return_entropy else out[0]


def attach_sp_log_prob_method(model: nn.Module, sp_group) -> nn.Module:
    """Give `model` a `token_log_probs(...)` method that runs under sequence parallelism over
    `sp_group` (FSDP2 treats it like forward), and switch its attention to "ulysses_sdpa".

    The drop-in for tinyzero.workers.forward.attach_log_prob_method: `response_log_probs` then
    works unchanged, padded or packed, on every rank of the group.
    """
    import functools
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    if model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head); a causal LM is needed")
    cfg = model.config
    check_heads(cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                sp_world(sp_group))
    model.set_attn_implementation(ULYSSES_ATTENTION)
    method = functools.partial(sp_token_log_probs, sp_group=sp_group)
    model.token_log_probs = types.MethodType(method, model)
    register_fsdp_forward_method(model, "token_log_probs")
    return model


def sp_model_forward(model: nn.Module, input_ids, attention_mask, position_ids, group):
    """`model(...)` on a full micro-batch under sequence parallelism; the output's first tensor
    (logits, or a value head's output) gathered to (batch, seq, ...) on every rank.

    For heads with few channels (critic values, reward scores): the gathered tensor is small.
    """
    split = split_for_sp(input_ids, attention_mask, position_ids, group)
    out = model(**split.model_kwargs())
    t = out.logits if hasattr(out, "logits") else (out.last_hidden_state if hasattr(out, "last_hidden_state") else out)
    return gather_from_sp(t, group, split.pad)
