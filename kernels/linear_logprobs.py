"""Log-probs (and entropy) straight from hidden states and the lm_head weight.

`linear_log_probs(hidden, weight, labels, temperature=1.0, return_entropy=False)` computes
log softmax(hidden @ weight.T / T)[label] without ever holding the (tokens, vocab) logits:
tokens are processed in chunks, so the extra memory is O(chunk x vocab) in the forward and in
the backward, which recomputes each chunk's logits instead of saving them. The backward returns
gradients for `hidden` and `weight` (accumulated over chunks in float32); autograd adds the
weight gradient to whatever else uses that tensor, so an lm_head tied to the input embedding
works unchanged.

On CUDA the per-chunk reductions run the Triton kernels of logprobs_triton on the chunk's
logits in the matmul dtype (bf16 stays bf16); elsewhere the torch row path upcasts one chunk.
"""

from __future__ import annotations

import torch

from ._backend import use_triton
from .logprobs import rows_backward, rows_forward

_CHUNK_ELEMS = 1 << 24  # logits elements per token chunk (64 MiB in float32)


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk: about 16M logits, at least 16 tokens."""
    return max(16, _CHUNK_ELEMS // max(vocab, 1))


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temp, with_entropy, chunk, triton_path):
        tokens = hidden.shape[0]
        logp = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        for i in range(0, tokens, chunk):
            logits = hidden[i:i + chunk] @ weight.T  # (chunk, V) in the matmul dtype
            c_logp, c_ent, c_lse = rows_forward(logits, labels[i:i + chunk], inv_temp, with_entropy, triton_path)
            logp[i:i + chunk] = c_logp
            lse[i:i + chunk] = c_lse
            if with_entropy:
                ent[i:i + chunk] = c_ent
            del logits
        ctx.save_for_backward(hidden, weight, labels, lse, ent if with_entropy else lse)
        ctx.inv_temp, ctx.with_entropy, ctx.chunk, ctx.triton_path = inv_temp, with_entropy, chunk, triton_path
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.with_entropy:
            g_ent = None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        chunk = ctx.chunk
        for i in range(0, hidden.shape[0], chunk):
            h = hidden[i:i + chunk]  # (chunk, H)
            logits = h @ weight.T  # (chunk, V), recomputed
            sl = slice(i, i + chunk)
            # the gradient overwrites the recomputed logits chunk: no second (chunk, V) buffer
            g = rows_backward(logits, labels[sl], lse[sl], ent[sl], None if g_lp is None else g_lp[sl],
                              None if g_ent is None else g_ent[sl], ctx.inv_temp, ctx.triton_path, out=logits)
            if need_h:
                grad_h[sl] = g @ weight
            if need_w:
                if g.dtype == torch.float32 and h.dtype == torch.float32:
                    grad_w.addmm_(g.T, h)
                else:
                    grad_w.addmm_(g.T.float(), h.float())
            del logits, g
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     return_entropy: bool = False, chunk_size: int | None = None, backend: str = "auto"):
    """log softmax(hidden @ weight.T / T) at `labels`, float32, labels' shape; entropy if asked.

    hidden: (..., H); weight: (V, H) (lm_head or the tied embedding); labels: (...) ids in [0, V).
    chunk_size: tokens per chunk (default about 16M logits per chunk).
    Returns `log_probs` or `(log_probs, entropy)`; differentiable w.r.t. hidden and weight.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden shape without the hidden dim "
                         f"{tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, hidden={hidden.shape[-1]}); got {tuple(weight.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    triton_path = use_triton(hidden, backend) and weight.dtype != torch.float64
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    shape = labels.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _LinearLogProbs.apply(flat, weight, labels.reshape(-1).long(), 1.0 / float(temperature),
                                      bool(return_entropy), chunk, triton_path)
    if return_entropy:
        return logp.view(shape), ent.view(shape)
    return logp.view(shape)
