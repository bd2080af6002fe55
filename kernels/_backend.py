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
    return auto_triton(x.is_cuda, x.device)


_triton_works: dict[str, bool] = {}


def auto_triton(is_cuda: bool, device=None) -> bool:
    """backend="auto": Triton for CUDA tensors when it imports and compiles there. The first call on a
    device compiles and runs one small kernel against the torch path; when that fails (no C compiler
    for Triton's launcher, a GPU its compiler does not support, a broken install) every kernel takes
    the torch path for the rest of the process, said once as a warning naming the cause."""
    if not (HAS_TRITON and is_cuda):
        return False
    key = str(device)
    if key not in _triton_works:
        _triton_works[key] = _probe(device)
    return _triton_works[key]


def _probe(device) -> bool:
    try:
        from . import scan_triton
        from .scan import reverse_linear_scan_torch

        a = torch.full((2, 5), 0.5, device=device)
        b = torch.arange(10.0, device=device).view(2, 5)
        ok = torch.allclose(scan_triton.reverse_linear_scan(a, b), reverse_linear_scan_torch(a, b))
        cause = "its result differs from the torch path's"
    except Exception as e:  # anything Triton raises while compiling or launching
        ok, cause = False, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if not ok:
        import warnings

        warnings.warn(f"Triton kernels cannot run on {device} ({cause}); tinyzero's kernels take the torch path "
                      "(same results, slower). Fix the Triton install (it needs a C compiler) or pass "
                      "backend='torch' to silence this", RuntimeWarning, stacklevel=3)
    return ok
