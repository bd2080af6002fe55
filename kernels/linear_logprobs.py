"""Log-probs (and entropy) straight from hidden states and the lm_head weight.

`linear_log_probs(hidden, weight, labels, temperature=1.0, return_entropy=False)` computes
log softmax(hidden @ weight.T / T)[label] without ever holding the (tokens, vocab) logits.
Tokens are processed in chunks, and the backward recomputes each chunk's logits instead of
saving them, so the extra memory is O(chunk x vocab) in both passes. The backward returns
gradients for `hidden` and `weight` (the weight gradient accumulated over chunks in float32);
autograd adds it to whatever else uses that tensor, so an lm_head tied to the input embedding
works unchanged.

* CUDA (Triton): per token chunk, the (chunk, V) logits are one cuBLAS matmul in the weight
  dtype (bf16 stays bf16) and the logprobs_triton kernels reduce each row in one pass.
* torch (CPU and the reference): each token chunk is further tiled over the vocabulary, with
  an online log-sum-exp / entropy across vocabulary tiles (the same recurrence as the Triton
  kernel). The weight is then streamed from memory once per token chunk, not once per
  (small) chunk, and a tile is (chunk, vocab_block) instead of (chunk, V). Up to
  `keep_logits_bytes` of the forward's tiles (256 MiB by default) are kept for the backward
  instead of recomputed: the logits of a few hundred response tokens of a 50k vocabulary cost
  one (tokens, V) matmul of the four the head needs, and this much memory.
The label logit is taken as the dot product hidden . weight[label] on the torch path.
"""

from __future__ import annotations

import torch

from ._backend import use_triton
from .logprobs import compute_dtype, rows_backward, rows_forward

_TRITON_CHUNK_ELEMS = 1 << 25  # logits per token chunk on the Triton path (64 MiB in bf16)
_TORCH_CHUNK_TOKENS = 2048  # tokens per chunk on the torch path
_TORCH_TILE_ELEMS = 1 << 23  # float32 logits per (tokens, vocab) tile on the torch path (32 MiB)
_TORCH_KEEP_BYTES = 256 << 20  # logits the torch path keeps from forward for backward, per call


def default_chunk_size(vocab: int, triton_path: bool = True) -> int:
    """Tokens per chunk: about 32M logits on the Triton path, 2048 on the torch path."""
    if triton_path:
        return max(16, _TRITON_CHUNK_ELEMS // max(vocab, 1))
    return _TORCH_CHUNK_TOKENS


def _vocab_block(tokens: int, vocab: int) -> int:
    return max(256, min(vocab, _TORCH_TILE_ELEMS // max(tokens, 1)))


def _tile_logits(h: torch.Tensor, w: torch.Tensor, inv_temp: float) -> torch.Tensor:
    x = (h @ w.T).to(compute_dtype(w.dtype))  # (tokens, block) float32 (float64 for float64 weights)
    if inv_temp != 1.0:
        x.mul_(inv_temp)
    return x


def _label_logits(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, inv_temp: float) -> torch.Tensor:
    cdt = compute_dtype(weight.dtype)
    return torch.linalg.vecdot(h.to(cdt), weight[labels].to(cdt)) * inv_temp  # (tokens,)


def _torch_chunk_forward(h, weight, labels, inv_temp, with_entropy, keep: list | None = None):
    """(logp, entropy or None, lse) for one token chunk, online over vocabulary tiles. `keep`: a list
    that gets each tile as (logits - m, m), m its rows' running max (for the backward)."""
    vocab = weight.shape[0]
    block = _vocab_block(h.shape[0], vocab)
    m = s = w = None
    for v0 in range(0, vocab, block):
        x = _tile_logits(h, weight[v0:v0 + block], inv_temp)  # (tokens, block)
        tile_max = x.amax(dim=-1)
        m_new = tile_max if m is None else torch.maximum(m, tile_max)
        x.sub_(m_new.unsqueeze(-1))  # x - m_new, in place
        p = torch.exp(x)
        tile_s = p.sum(dim=-1)
        if m is None:
            s = tile_s
            w = torch.linalg.vecdot(p, x) if with_entropy else None
        else:
            scale = torch.exp(m - m_new)
            if with_entropy:
                w = (w + (m - m_new) * s) * scale + torch.linalg.vecdot(p, x)
            s = s * scale + tile_s
        m = m_new
        if keep is not None:
            keep.append((x, m_new))
        del x, p
    log_s = torch.log(s)
    lse = m + log_s
    logp = _label_logits(h, weight, labels, inv_temp) - lse
    return logp, (log_s - w / s if with_entropy else None), lse


def _torch_chunk_backward(h, weight, labels, lse, ent, g_lp, g_ent, inv_temp, grad_w, kept: list | None = None):
    """Gradient w.r.t. one token chunk of hidden; adds the chunk's weight gradient into grad_w.
    `kept`: the forward's tiles (`_torch_chunk_forward(keep=)`), used up (in place) instead of recomputed."""
    vocab = weight.shape[0]
    block = _vocab_block(h.shape[0], vocab)
    grad_h = torch.zeros(h.shape, dtype=compute_dtype(weight.dtype), device=h.device)
    rows = torch.arange(h.shape[0], device=h.device)
    for i, v0 in enumerate(range(0, vocab, block)):
        w_tile = weight[v0:v0 + block]
        if kept:
            x, m = kept[i]
            kept[i] = None
            x.add_((m - lse).unsqueeze(-1))  # log p, in place
        else:
            x = _tile_logits(h, w_tile, inv_temp)
            x.sub_(lse.unsqueeze(-1))  # log p, in place
        g = torch.exp(x)  # p
        if g_ent is not None:
            # d entropy / dx = -p * (log p + entropy)
            g_entropy = g * (x + ent.unsqueeze(-1))
            g_entropy.mul_(g_ent.unsqueeze(-1))
        if g_lp is not None:
            g.mul_(-g_lp.unsqueeze(-1))
            inside = (labels >= v0) & (labels < v0 + w_tile.shape[0])
            g[rows[inside], labels[inside] - v0] += g_lp[inside]
        else:
            g.zero_()
        if g_ent is not None:
            g.sub_(g_entropy)
            del g_entropy
        if inv_temp != 1.0:
            g.mul_(inv_temp)
        del x
        grad_h.addmm_(g, w_tile.to(g.dtype))  # g is float32 (float64 for float64 weights)
        if grad_w is not None:
            grad_w[v0:v0 + block].addmm_(g.T, h.to(g.dtype))
    return grad_h


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temp, with_entropy, chunk, triton_path, keep_bytes):
        tokens = hidden.shape[0]
        logp = torch.empty(tokens, dtype=compute_dtype(weight.dtype), device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        kept = []  # per token chunk of the torch path: its tiles, or None (recomputed in backward)
        for i in range(0, tokens, chunk):
            sl = slice(i, i + chunk)
            if triton_path:
                logits = hidden[sl] @ weight.T  # (chunk, V) in the matmul dtype
                out = (logp[sl], ent[sl] if with_entropy else None, lse[sl])
                rows_forward(logits, labels[sl], inv_temp, with_entropy, True, out=out)
                del logits
            else:
                nbytes = hidden[sl].shape[0] * weight.shape[0] * logp.element_size()
                keep = [] if nbytes <= keep_bytes and any(ctx.needs_input_grad[:2]) else None
                if keep is not None:
                    keep_bytes -= nbytes
                c_logp, c_ent, c_lse = _torch_chunk_forward(hidden[sl], weight, labels[sl], inv_temp, with_entropy, keep)
                kept.append(keep)
                logp[sl], lse[sl] = c_logp, c_lse
                if with_entropy:
                    ent[sl] = c_ent
        ctx.save_for_backward(hidden, weight, labels, lse, ent if with_entropy else lse)
        ctx.inv_temp, ctx.with_entropy, ctx.chunk, ctx.triton_path = inv_temp, with_entropy, chunk, triton_path
        ctx.kept = kept
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, []  # used up: a second backward (retain_graph) recomputes
        grad_h, grad_w = backward_chunks(hidden, weight, labels, lse, ent, g_lp, g_ent if ctx.with_entropy else None,
                                         ctx.inv_temp, ctx.chunk, ctx.triton_path, ctx.needs_input_grad[0],
                                         ctx.needs_input_grad[1], kept)
        return grad_h, grad_w, None, None, None, None, None, None


def accumulate_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w (float32 or float64) += g.T @ h, one token chunk's share of the head's weight gradient.

    Same-dtype operands take addmm_ directly. Low-precision ones (bf16 / fp16 on the Triton path) run as a
    low-precision GEMM, not as float32 copies of the (chunk, V) gradient and a float32 GEMM (several times
    slower on tensor cores, and a (chunk, V) float32 buffer): with `out_dtype` where torch has it for the
    device (CUDA: float32 accumulation and output), else with float32 accumulation inside the GEMM and
    the chunk's product rounded once to the operands' dtype before it is summed in grad_w's dtype.
    Only a GPU measures the speed; the result is checked against float64 on CPU."""
    if g.dtype == grad_w.dtype and h.dtype == grad_w.dtype:
        grad_w.addmm_(g.T, h)
        return
    if g.dtype == h.dtype and g.dtype in (torch.bfloat16, torch.float16):
        if g.is_cuda:
            try:
                grad_w.add_(torch.mm(g.T, h, out_dtype=grad_w.dtype))
                return
            except (TypeError, RuntimeError, NotImplementedError):  # torch without mm(out_dtype=) for this device
                pass
        grad_w.add_(g.T @ h)
        return
    grad_w.addmm_(g.T.to(grad_w.dtype), h.to(grad_w.dtype))


def backward_chunks(hidden, weight, labels, lse, ent, g_lp, g_ent, inv_temp, chunk, triton_path, need_h, need_w,
                    kept: list | None = None):
    """(grad hidden or None, grad weight or None) of log-probs / entropy given per-token lse and entropy.

    Labels outside [0, V) add no label term (the vocabulary-parallel path passes shard-local labels).
    kept: per token chunk, the forward's tiles or None (torch path; see `_torch_chunk_forward`).
    """
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=compute_dtype(weight.dtype), device=weight.device) if need_w else None
    grad_dtype = compute_dtype(weight.dtype)
    for n, i in enumerate(range(0, hidden.shape[0], chunk)):
        sl = slice(i, i + chunk)
        h = hidden[sl]  # (chunk, H)
        c_g_lp = None if g_lp is None else g_lp[sl].to(grad_dtype)
        c_g_ent = None if g_ent is None else g_ent[sl].to(grad_dtype)
        if not triton_path:
            c_grad_h = _torch_chunk_backward(h, weight, labels[sl], lse[sl], ent[sl], c_g_lp, c_g_ent, inv_temp,
                                             grad_w, kept[n] if kept and n < len(kept) else None)
            if need_h:
                grad_h[sl] = c_grad_h
            continue
        logits = h @ weight.T  # (chunk, V), recomputed
        # the gradient overwrites the recomputed logits: no second (chunk, V) buffer
        g = rows_backward(logits, labels[sl], lse[sl], ent[sl], c_g_lp, c_g_ent, inv_temp, True, out=logits)
        if need_h:
            grad_h[sl] = g @ weight
        if need_w:
            accumulate_weight_grad(grad_w, g, h)
        del logits, g
    if need_w:
        grad_w = grad_w.to(weight.dtype)
    return grad_h, grad_w


def flat_inputs(hidden, weight, chunk_size, backend):
    """(hidden as (tokens, H) in the weight's dtype, tokens per chunk, whether the Triton path runs)."""
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    triton_path = use_triton(hidden, backend) and weight.dtype != torch.float64
    chunk = chunk_size or default_chunk_size(weight.shape[0], triton_path)
    return hidden.reshape(-1, hidden.shape[-1]), chunk, triton_path


def check_args(hidden, weight, labels, temperature, chunk_size, weight_name: str = "weight") -> None:
    """ValueError naming the argument for shapes, temperature or chunk size that cannot work."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden shape without the hidden dim "
                         f"{tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{weight_name} must be (vocab, hidden={hidden.shape[-1]}); got {tuple(weight.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     return_entropy: bool = False, chunk_size: int | None = None, backend: str = "auto",
                     keep_logits_bytes: int | None = None):
    """log softmax(hidden @ weight.T / T) at `labels`, labels' shape; entropy if asked.

    hidden: (..., H); weight: (V, H) (lm_head or the tied embedding); labels: (...) ids in [0, V).
    chunk_size: tokens per chunk (default: about 32M logits on CUDA, 2048 tokens on the torch path).
    keep_logits_bytes: on the torch path, how much of the forward's logits backward reuses instead of
    recomputing (default 256 MiB; 0 recomputes all). Only when a gradient is wanted.
    Outputs are float32, or float64 for float64 weights (which take the torch path).
    Returns `log_probs` or `(log_probs, entropy)`; differentiable w.r.t. hidden and weight.
    A DTensor weight sharded along the vocabulary (tensor parallelism) takes the vocabulary-parallel
    path (kernels.vocab_parallel): no rank builds the full vocabulary's logits.
    """
    check_args(hidden, weight, labels, temperature, chunk_size)
    if _is_dtensor(weight):  # lm_head sharded along the vocabulary by tensor parallelism
        from .vocab_parallel import dtensor_log_probs

        return dtensor_log_probs(hidden, weight, labels, temperature, return_entropy, chunk_size, backend)
    flat, chunk, triton_path = flat_inputs(hidden, weight, chunk_size, backend)
    shape = labels.shape
    keep = _TORCH_KEEP_BYTES if keep_logits_bytes is None else int(keep_logits_bytes)
    logp, ent = _LinearLogProbs.apply(flat, weight, labels.reshape(-1).long(), 1.0 / float(temperature),
                                      bool(return_entropy), chunk, triton_path, keep)
    if return_entropy:
        return logp.view(shape), ent.view(shape)
    return logp.view(shape)


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
