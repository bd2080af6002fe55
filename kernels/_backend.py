"""Backend choice shared by the kernels: Triton on CUDA tensors, torch everywhere else.

Every public kernel function takes `backend="auto" | "torch" | "triton"`. "auto" picks Triton
when the tensors live on a CUDA device and Triton imports; "triton" forces the Triton kernels
(the tests use it on CPU tensors under TRITON_INTERPRET=1); "torch" forces the reference path.
"""

from __future__ import annotations

import importlib.util
import os

import torch

# Triton is optional (CPU-only installs run the torch paths). It is imported only when a
# Triton kernel first runs, so importing tinyzero.kernels stays cheap and does not fix
# Triton's interpreter setting (TRITON_INTERPRET is read when kernels are decorated).
HAS_TRITON = importlib.util.find_spec("triton") is not None

BACKENDS = ("auto", "torch", "triton")


def triton_interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor, backend: str) -> bool:
    """Decide whether the Triton path runs for tensor `x` under `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; use one of {BACKENDS}")
    if backend == "torch":
        return False
    if backend == "triton":
        if not HAS_TRITON:
            raise ValueError("backend='triton' needs the triton package; install it or use backend='torch'")
        if not x.is_cuda and not triton_interpreting():
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is "
                             "imported; use backend='torch' (or 'auto') on CPU")
        return True
    return HAS_TRITON and x.is_cuda
