"""Token log-probs and entropy from logits, with a memory-lean backward.

`log_probs_from_logits(logits, labels, temperature=1.0, return_entropy=False)`:
    log softmax(logits / T)[label] (and the entropy of softmax(logits / T)), in float32 (float64
    for float64 logits: the input's precision is kept), in the labels' shape. On CUDA it runs the Triton kernels of logprobs_triton (one pass over the
    vocabulary per row, no float32 copy of the logits). Elsewhere the torch path works on
    chunks of rows, upcasting one chunk at a time, so its extra memory is one chunk's float32
    logits, not the whole tensor's.

Numerics versus veRL (`verl.utils.torch_functional`): the same quantities
(`logprobs_from_logits`, `entropy_from_logits`). Deliberate differences: the temperature is
applied after the upcast to float32 (veRL divides the bf16 logits in place first) and bf16
logits are reduced in float32 (veRL's fallback runs log_softmax in bf16); both are more
accurate, not less. The entropy is summed as log S - sum(p z) / S with z = logits - max and
S = sum exp(z): both terms are >= 0, so nothing cancels. The textbook lse - sum(p x) subtracts
two numbers of the size of the logits and loses |x| x eps_fp32 (about 3e-4 at logit scale 30,
where entropy collapse is watched); veRL's form has the same loss.

The row helpers `rows_forward` / `rows_backward` are shared with linear_log_probs.
"""

from __future__ import annotations

import torch

from ._backend import use_triton

_CHUNK_ELEMS = 1 << 22  # float32 elements per row chunk of the torch path (16 MiB)


def _rows_per_chunk(vocab: int) -> int:
    return max(1, _CHUNK_ELEMS // max(vocab, 1))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the reductions run and the outputs come in: float32, or float64 for float64 input."""
    return torch.promote_types(dtype, torch.float32)


def entropy_rows(x: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over the last dim of x (already scaled by 1/T), as log S - sum(p z) / S.

    z = x - max(x) and p = exp(z): both terms are >= 0, so the sum loses no digits to
    cancellation (see the module docstring); -inf logits (p = 0) contribute 0.
    """
    z = x - x.amax(dim=-1, keepdim=True)  # (rows, V), <= 0
    p = torch.exp(z)
    s = p.sum(dim=-1)  # (rows,), >= 1
    return torch.log(s) - torch.linalg.vecdot(p, z.masked_fill_(p == 0, 0.0)) / s


def rows_forward_torch(logits: torch.Tensor, labels: torch.Tensor, inv_temp: float, with_entropy: bool, out=None):
    """(logp, entropy or None, lse) (rows,), from 2-D logits, one row chunk at a time.

    Outputs are float32 (float64 for float64 logits); out: optional preallocated
    (logp, entropy or None, lse) to write into.
    """
    rows, vocab = logits.shape
    cdt = compute_dtype(logits.dtype)
    if out is None:
        logp = torch.empty(rows, dtype=cdt, device=logits.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
    else:
        logp, ent, lse = out
    step = _rows_per_chunk(vocab)
    for i in range(0, rows, step):
        x = logits[i:i + step].to(cdt)  # (chunk, V)
        if inv_temp != 1.0:
            x = x * inv_temp
        c_lse = torch.logsumexp(x, dim=-1)  # (chunk,)
        lse[i:i + step] = c_lse
        logp[i:i + step] = x.gather(-1, labels[i:i + step].unsqueeze(-1)).squeeze(-1) - c_lse
        if with_entropy:
            ent[i:i + step] = entropy_rows(x)
    return logp, ent, lse


def rows_backward_torch(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
                        g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, inv_temp: float,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient w.r.t. 2-D logits, computed per row chunk in float32 (float64 for float64 logits),
    stored in the logits' dtype."""
    rows, vocab = logits.shape
    cdt = compute_dtype(logits.dtype)
    grad = torch.empty_like(logits) if out is None else out
    step = _rows_per_chunk(vocab)
    for i in range(0, rows, step):
        x = logits[i:i + step].to(cdt)
        if inv_temp != 1.0:
            x = x * inv_temp
        logp = x - lse[i:i + step].unsqueeze(-1)  # (chunk, V)
        p = torch.exp(logp)
        g = torch.zeros_like(p)
        if g_lp is not None:
            glp = g_lp[i:i + step].to(cdt).unsqueeze(-1)  # (chunk, 1)
            g = -p * glp
            g.scatter_add_(-1, labels[i:i + step].unsqueeze(-1), glp)
        if g_ent is not None:
            gent = g_ent[i:i + step].to(cdt).unsqueeze(-1)
            g = g - gent * p * (logp + ent[i:i + step].unsqueeze(-1))
        if inv_temp != 1.0:
            g = g * inv_temp
        grad[i:i + step] = g
    return grad


def rows_forward(logits, labels, inv_temp, with_entropy, triton_path: bool, out=None):
    """Dispatch to the Triton or torch row forward (see rows_forward_torch)."""
    if triton_path:
        from . import logprobs_triton

        return logprobs_triton.rows_forward(logits, labels, inv_temp, with_entropy, out)
    return rows_forward_torch(logits, labels, inv_temp, with_entropy, out)


def rows_backward(logits, labels, lse, ent, g_lp, g_ent, inv_temp, triton_path: bool, out=None):
    """Dispatch to the Triton or torch row backward (see rows_backward_torch)."""
    if triton_path:
        from . import logprobs_triton

        return logprobs_triton.rows_backward(logits, labels, lse, ent, g_lp, g_ent, inv_temp, out)
    return rows_backward_torch(logits, labels, lse, ent, g_lp, g_ent, inv_temp, out)


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, inv_temp, with_entropy, triton_path):
        logp, ent, lse = rows_forward(logits, labels, inv_temp, with_entropy, triton_path)
        ctx.save_for_backward(logits, labels, lse, ent if with_entropy else lse)
        ctx.inv_temp, ctx.with_entropy, ctx.triton_path = inv_temp, with_entropy, triton_path
        if with_entropy:
            return logp, ent
        return logp, None

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, labels, lse, ent = ctx.saved_tensors
        if not ctx.with_entropy:
            g_ent = None
        grad = rows_backward(logits, labels, lse, ent, g_lp, g_ent, ctx.inv_temp, ctx.triton_path)
        return grad, None, None, None, None


def _check_inputs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab dim "
                         f"{tuple(logits.shape[:-1])}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point; got {logits.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                          return_entropy: bool = False, backend: str = "auto"):
    """log softmax(logits / T) at `labels` (labels' shape); with entropy if asked.

    logits: (..., V) in bf16 / fp16 / fp32 / fp64; labels: (...) integer ids in [0, V).
    Outputs are float32, or float64 for float64 logits (which take the torch path). Differentiable w.r.t. logits (both outputs). Returns `log_probs` or `(log_probs, entropy)`.
    """
    _check_inputs(logits, labels, temperature)
    triton_path = use_triton(logits, backend) and logits.dtype != torch.float64
    shape = labels.shape
    flat = logits.reshape(-1, logits.shape[-1])
    logp, ent = _LogProbs.apply(flat, labels.reshape(-1).long(), 1.0 / float(temperature), bool(return_entropy),
                                triton_path)
    if return_entropy:
        return logp.view(shape), ent.view(shape)
    return logp.view(shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, backend: str = "auto") -> torch.Tensor:
    """Entropy of softmax(logits / T) per position (float32; float64 for float64 logits), shape
    logits.shape[:-1]; differentiable."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return log_probs_from_logits(logits, labels, temperature, return_entropy=True, backend=backend)[1]
