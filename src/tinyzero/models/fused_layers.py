"""Lean RMSNorm and SwiGLU for training: the same forward as the HF modules, less kept for backward.

    apply_fused_layers(model)        # before FSDP2 (model.use_fused_layers); returns modules changed

Autograd keeps what each op needs for its backward. In a Llama-family decoder layer the two
RMSNorms and the gated MLP keep more than their math needs:

* HF's RMSNorm (x -> weight * (x * rsqrt(mean(x^2) + eps)) in fp32) keeps x in fp32, the
  normalised x and rsqrt: two full-width tensors per norm, in fp32 even under bf16 mixed
  precision. `RMSNormFunction` keeps x in its own dtype and the per-token rsqrt, and recomputes the
  normalised x in backward (one multiply).
* The MLP's down_proj(act(gate) * up) keeps gate (for the activation), act(gate) and up (for the
  product), and the product h (for down_proj's weight gradient). `SwiGLUDownFunction` keeps gate
  and up, and recomputes silu(gate) and h in backward (`SwiGLUFunction`, without down_proj, where
  down_proj is not a plain nn.Linear, e.g. a LoRA layer, or under autocast).

Per token and layer that is about a third of the activation memory in fp32 (more under bf16
autocast of the norms' fp32 copies), for a few elementwise ops in backward. The forward is the HF
modules' op for op (the same values); gradients agree with autograd's through the HF modules to
rounding (tests/test_fused_layers.py: float64, fp32, bf16). Modules are changed in place by
replacing their `forward` (parameters, names and state dicts are untouched, so loading, sharding,
checkpoints and weight sync do not see it). Applies to RMSNorms with `weight` and
`variance_epsilon` (Llama, Qwen2, Qwen3, Mistral) and to MLPs with gate/up/down projections and a
SiLU activation; not under tensor parallelism (its norms and projections run on DTensors).
"""

from __future__ import annotations

import types

import torch
from torch import nn


class RMSNormFunction(torch.autograd.Function):
    """weight * (x * rsqrt(mean(x^2, -1) + eps)), computed in fp32 as HF does; keeps x and rsqrt."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(torch.float32) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            lead = tuple(range(grad.dim() - 1))
            grad_weight = (grad.to(torch.float32) * xhat.to(x.dtype)).sum(lead).to(weight.dtype)
        gn = (grad * weight).to(torch.float32)  # the gradient of the normalised x (the cast passes it on)
        grad_x = rstd * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up; keeps gate and up, recomputes silu(gate) in backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up, _ = _swiglu_backward(grad, gate, up)
        return grad_gate, grad_up


def _swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """Gradients of silu(gate) * up for the product's gradient `grad`: (grad_gate, grad_up, silu(gate))."""
    sig = torch.sigmoid(gate)
    silu = gate * sig
    grad_up = grad * silu
    grad_gate = grad * up * (sig * (1 + gate * (1 - sig)))  # d silu / d gate = sig + gate sig (1 - sig)
    return grad_gate, grad_up, silu


class SwiGLUDownFunction(torch.autograd.Function):
    """linear(silu(gate) * up, weight, bias); keeps gate, up (and the weight, as nn.Linear does) and
    recomputes silu(gate) * up in backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return nn.functional.linear(nn.functional.silu(gate) * up, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        grad_gate, grad_up, silu = _swiglu_backward(grad.matmul(weight), gate, up)
        flat = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            h = silu * up
            grad_weight = flat.t().matmul(h.reshape(-1, h.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = flat.sum(0)
        return grad_gate, grad_up, grad_weight, grad_bias


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def _swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    down = self.down_proj
    if type(down) is nn.Linear and not torch.is_autocast_enabled(x.device.type):
        return SwiGLUDownFunction.apply(self.gate_proj(x), self.up_proj(x), down.weight, down.bias)
    return down(SwiGLUFunction.apply(self.gate_proj(x), self.up_proj(x)))


def is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor) \
        and hasattr(module, "variance_epsilon")


def is_swiglu_mlp(module: nn.Module) -> bool:
    if not all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")):
        return False
    act = getattr(module, "act_fn", None)
    if not callable(act):
        return False
    probe = torch.linspace(-4.0, 4.0, 9)
    return torch.equal(act(probe), nn.functional.silu(probe))  # nn.SiLU, transformers' SiLUActivation, ...


def apply_fused_layers(model: nn.Module) -> int:
    """Give every RMSNorm and SwiGLU MLP of `model` the lean forward; returns how many were changed."""
    count = 0
    for module in model.modules():
        if is_rms_norm(module):
            module.forward = types.MethodType(_rms_norm_forward, module)
            count += 1
        elif is_swiglu_mlp(module):
            module.forward = types.MethodType(_swiglu_mlp_forward, module)
            count += 1
    return count
