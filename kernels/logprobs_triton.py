"""Triton kernels: per-row log-prob of a label, entropy and log-sum-exp in one pass over V.

Forward (one program per row): an online softmax over vocabulary blocks keeps the running
max m, S = sum exp(x - m) and W = sum exp(x - m) * (x - m); when the max grows to m', both
are rescaled by exp(m - m') and W gains (m - m') * S. Then
    lse = m + log S,   log p(label) = x[label] - lse,   entropy = log S - W / S.
Logits are read in their own dtype (bf16 / fp16 / fp32) and upcast in registers; no float32
copy of the logits is made. Outputs are float32.

Backward (one program per row, a second pass over V): with p = exp(x - lse),
    d logp / dx_j   = [j == label] - p_j
    d entropy / dx_j = -p_j * (log p_j + entropy)
and x = logits / T, so the gradient w.r.t. the logits is divided by T. It is written in the
logits' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fwd_kernel(logits_ptr, labels_ptr, logp_ptr, ent_ptr, lse_ptr, vocab, stride_row, inv_temp,
                BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    m = tl.full((), -1e30, dtype=tl.float32)  # finite start: exp(m - m') stays 0 without inf - inf
    s = tl.zeros((), dtype=tl.float32)
    w = tl.zeros((), dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        scale = tl.exp(m - m_new)
        p = tl.exp(x - m_new)
        if WITH_ENTROPY:
            w = (w + (m - m_new) * s) * scale + tl.sum(p * tl.where(p > 0, x - m_new, 0.0), axis=0)
        s = s * scale + tl.sum(p, axis=0)
        m = m_new
    label = tl.load(labels_ptr + row).to(tl.int64)
    ok = (label >= 0) & (label < vocab)
    x_label = tl.load(base + label, mask=ok, other=float("nan")).to(tl.float32) * inv_temp
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(logp_ptr + row, x_label - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        tl.store(ent_ptr + row, log_s - w / s)


@triton.jit
def _bwd_kernel(logits_ptr, labels_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, grad_ptr, vocab, stride_row,
                stride_grad, inv_temp, BLOCK_V: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lse = tl.load(lse_ptr + row)
    label = tl.load(labels_ptr + row).to(tl.int64)
    g_lp = tl.zeros((), dtype=tl.float32)
    if HAS_G_LP:
        g_lp = tl.load(g_lp_ptr + row).to(tl.float32)
    g_ent = tl.zeros((), dtype=tl.float32)
    ent = tl.zeros((), dtype=tl.float32)
    if HAS_G_ENT:
        g_ent = tl.load(g_ent_ptr + row).to(tl.float32)
        ent = tl.load(ent_ptr + row)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        inb = offs < vocab
        x = tl.load(base + offs, mask=inb, other=-float("inf")).to(tl.float32) * inv_temp
        logp = x - lse
        p = tl.exp(logp)
        g = tl.where(offs == label, g_lp, 0.0) - g_lp * p
        if HAS_G_ENT:
            g -= g_ent * p * (tl.where(p > 0, logp, 0.0) + ent)
        tl.store(grad_ptr + row * stride_grad + offs, (g * inv_temp).to(grad_ptr.dtype.element_ty), mask=inb)


def _block_v(vocab: int) -> int:
    return max(16, min(4096, triton.next_power_of_2(vocab)))


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 4096 else 4


def rows_forward(logits: torch.Tensor, labels: torch.Tensor, inv_temp: float, with_entropy: bool, out=None):
    """(logp, entropy or None, lse), float32 (rows,), for 2-D logits (rows, V).

    out: optional preallocated contiguous float32 (logp, entropy or None, lse) to write into.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    labels = labels.contiguous()
    if out is None:
        logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else lse  # dummy pointer when unused
    else:
        logp, ent, lse = out
        ent = ent if with_entropy else lse
    if rows:
        block = _block_v(vocab)
        _fwd_kernel[(rows,)](logits, labels, logp, ent, lse, vocab, logits.stride(0), float(inv_temp),
                             BLOCK_V=block, WITH_ENTROPY=with_entropy, num_warps=_num_warps(block))
    return logp, (ent if with_entropy else None), lse


def rows_backward(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
                  g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, inv_temp: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient w.r.t. 2-D logits (rows, V), in the logits' dtype (or written into `out`)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    grad = torch.empty_like(logits) if out is None else out
    has_ent = g_ent is not None
    has_lp = g_lp is not None
    if rows:
        block = _block_v(vocab)
        _bwd_kernel[(rows,)](
            logits, labels.contiguous(), lse, ent if has_ent else lse,
            g_lp.float().contiguous() if has_lp else lse, g_ent.float().contiguous() if has_ent else lse,
            grad, vocab, logits.stride(0), grad.stride(0), float(inv_temp),
            BLOCK_V=block, HAS_G_LP=has_lp, HAS_G_ENT=has_ent, num_warps=_num_warps(block))
    return grad
