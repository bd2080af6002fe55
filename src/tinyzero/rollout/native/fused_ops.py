"""Building blocks of the native engine's fused decoder (decoder.py): rope, fused
q/k/v and gate/up weights (and their unmerged LoRA adapters), and HF's Llama-family ops called
without the nn.Module overhead, each equal to the HF op it replaces.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (..., D) with cos, signed_sin broadcastable to it, signed_sin = cat(-sin[:D/2], sin[D/2:]).

    Equals HF's x*cos + rotate_half(x)*sin bit for bit: rotate_half(x) = cat(-x2, x1) and the
    halves swapped, cat(x2, x1) (a roll by D/2, one gather), differ by the sign folded into
    signed_sin, and negating a factor or the product is exact."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (sum of out, in) weight (and bias) for linears that share their input; each module's
    parameters become views into it, so in-place weight updates land in the fused buffer."""
    weight = torch.cat([m.weight.detach() for m in linears], dim=0)
    has_bias = [m.bias is not None for m in linears]
    bias = torch.cat([m.bias.detach() for m in linears], dim=0) if all(has_bias) else None
    start = 0
    for m in linears:  # .data keeps the Parameter objects (and anyone's references to them) valid
        n = m.weight.shape[0]
        m.weight.data = weight[start:start + n]
        if bias is not None:
            m.bias.data = bias[start:start + n]
        start += n
    return weight, bias


def fuse_lora(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The unmerged LoRA adapters (models.lora.LoraLinear's lora_A / lora_B) of linears fused by `fuse_linears`:
    (A^T (in, sum of ranks), block-diagonal B^T (sum of ranks, sum of out), scaling), so the fused output
    gains x A^T B^T * scaling in two matmuls (`add_lora`). The adapters' weights become views into these
    (in-place adapter updates land in place); None when no linear carries an adapter."""
    adapted = [m for m in linears if getattr(m, "lora_A", None) is not None]
    if not adapted:
        return None
    scalings = {m.scaling for m in adapted}
    assert len(scalings) == 1, "one LoRA scaling per fused projection"
    a_cat, _ = fuse_linears([m.lora_A for m in adapted])  # (sum of ranks, in)
    b = a_cat.new_zeros(sum(m.weight.shape[0] for m in linears), a_cat.shape[0])  # zero off the blocks
    row = col = 0
    for m in linears:
        if any(m is a for a in adapted):
            out, rank = m.lora_B.weight.shape
            block = b[row:row + out, col:col + rank]
            block.copy_(m.lora_B.weight.detach())
            m.lora_B.weight.data = block
            col += rank
        row += m.weight.shape[0]
    return a_cat.t(), b.t(), scalings.pop()


def add_lora(y: torch.Tensor, x: torch.Tensor, lora: tuple | None) -> torch.Tensor:
    """y + x A^T B^T * scaling for `fuse_lora`'s triple (y itself when None); x (..., in), y (..., out)."""
    if lora is None:
        return y
    a_t, b_t, scaling = lora
    flat = torch.addmm(y.reshape(-1, y.shape[-1]), torch.mm(x.reshape(-1, x.shape[-1]), a_t), b_t, alpha=scaling)
    return flat.view(y.shape)


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """F.linear on an nn.Linear's weights (skips the module-call overhead on the decode path)."""
    if type(module) is nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module(x)


def weight_t(module: nn.Module) -> torch.Tensor | None:
    """The (in, out) view of a bias-free nn.Linear's weight for torch.mm (what F.linear runs on 2-D
    input, minus its dispatch and transpose per call); None for anything else (called as a module)."""
    if type(module) is nn.Linear and module.bias is None:
        return module.weight.t()
    return None


WIDE_MM_COLUMNS = 8192
"""Output width from which `wide_mm` splits an fp32 CPU matmul into column blocks."""
WIDE_MM_BLOCK = 768
"""Columns per block of `wide_mm`."""


def wide_mm(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """torch.mm(x, weight_t) for x (M, K) and a (K, N) weight view, computed in blocks of WIDE_MM_BLOCK
    output columns when it is fp32 on CPU with M >= 2 and N >= WIDE_MM_COLUMNS (lm_head, the fused
    gate/up of wider models). Every output element is the same dot product, bit for bit, while MKL's
    fp32 kernel runs faster on a block whose weights stay in cache for all the rows. One thread, 4 to 48
    rows, time against one call: 576 -> 49,152 (SmolLM2's lm_head) 0.72, 896 -> 9,728 0.70-0.85,
    2,048 -> 16,384 0.53-0.67; at 3,072 columns no gain. bf16 (oneDNN) and a single row (a gemv) do not
    gain, and a compiled decode step or an autograd graph (out= has no gradient) keeps the single call."""
    n = weight_t.shape[1]
    if n < WIDE_MM_COLUMNS or not _blocks_pay(x, weight_t):  # the width first: one compare for most calls
        return torch.mm(x, weight_t)
    out = x.new_empty((x.shape[0], n))
    for lo in range(0, n, WIDE_MM_BLOCK):
        torch.mm(x, weight_t[:, lo:lo + WIDE_MM_BLOCK], out=out[:, lo:lo + WIDE_MM_BLOCK])
    return out


def _blocks_pay(x: torch.Tensor, weight_t: torch.Tensor) -> bool:
    """Whether `wide_mm` splits a wide matmul: fp32 on CPU, several rows, not traced, no autograd."""
    if x.shape[0] < 2 or x.dtype != torch.float32 or x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight_t.requires_grad))


def mm(x: torch.Tensor, weight_t: torch.Tensor | None, module: nn.Module) -> torch.Tensor:
    """module(x) for 2-D x: torch.mm on the transposed view when `weight_t` gave one (`wide_mm`)."""
    return wide_mm(x, weight_t) if weight_t is not None else linear(module, x)


def rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's Llama-family RMSNorm, op for op (so bit-identical), minus the module-call overhead."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        return module(x)
    if x.dtype == torch.float32 and module.weight.dtype == torch.float32:
        # One fused op; in fp32 it equals HF's op sequence bit for bit (checked for hidden 64..3584).
        return F.rms_norm(x, (x.shape[-1],), module.weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return module.weight * h.to(x.dtype)


def norm_fn(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`rms_norm(module, .)` for the decode step, resolved once per batch: for an fp32 weight the
    fused op bound to it (the decode activations share the weights' dtype), else the general path."""
    eps = getattr(module, "variance_epsilon", None)
    weight = getattr(module, "weight", None)
    if eps is not None and weight is not None and weight.dtype == torch.float32:
        return functools.partial(torch.rms_norm, normalized_shape=(weight.shape[-1],), weight=weight, eps=eps)
    return functools.partial(rms_norm, module)


def act_fn(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation as a plain function where it is SiLU (no module call per step)."""
    return F.silu if type(module).__name__ in ("SiLU", "SiLUActivation") else module
