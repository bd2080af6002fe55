"""Triton kernels on a machine without a GPU: interpreter run and sm_90 compilation.

`test_triton_kernels_under_interpreter` runs test_kernels_triton_cases.py under the CPU
interpreter; `test_triton_kernels_compile_for_sm90` compiles every kernel for an H100-class GPU
(ptxas ships with triton), which catches type and layout errors the interpreter accepts.

Triton decides between compiling and interpreting when a function is decorated, including its
own standard library at `import triton`, so TRITON_INTERPRET=1 must be set before Triton is
first imported in a process. The cases therefore run in a fresh subprocess with the variable
set. Setting it in this process instead would also turn every later Triton kernel of the
session (vLLM's, on a GPU machine) into interpreted code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    root = Path(__file__).resolve().parents[1]
    cases = Path(__file__).with_name("test_kernels_triton_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=900)
    tail = f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"Triton interpreter cases failed:\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, tail


def _signatures():
    """(kernel, signature, constexprs) for every Triton kernel, in the dtypes the launchers use."""
    from tinyzero.kernels import logprobs_triton as lp
    from tinyzero.kernels import scan_triton as sc

    fwd = {"logits_ptr": "*bf16", "labels_ptr": "*i64", "logp_ptr": "*fp32", "ent_ptr": "*fp32", "lse_ptr": "*fp32",
           "vocab": "i32", "stride_row": "i64", "inv_temp": "fp32", "BLOCK_V": "constexpr", "WITH_ENTROPY": "constexpr"}
    bwd = {"logits_ptr": "*bf16", "labels_ptr": "*i64", "lse_ptr": "*fp32", "ent_ptr": "*fp32", "g_lp_ptr": "*fp32",
           "g_ent_ptr": "*fp32", "grad_ptr": "*bf16", "vocab": "i32", "stride_row": "i64", "stride_grad": "i64",
           "inv_temp": "fp32", "BLOCK_V": "constexpr", "HAS_G_LP": "constexpr", "HAS_G_ENT": "constexpr"}
    scan = {"a_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*fp32", "length": "i32", "stride_a": "i32",
            "stride_b": "i32", "stride_o": "i32", "BLOCK": "constexpr"}
    gae = {"r_ptr": "*fp32", "v_ptr": "*fp32", "m_ptr": "*fp32", "adv_ptr": "*fp32", "ret_ptr": "*fp32",
           "length": "i32", "stride_r": "i32", "stride_v": "i32", "stride_m": "i32", "stride_o": "i32",
           "gamma": "fp32", "gamma_lam": "fp32", "BLOCK": "constexpr"}
    gsum = {"x_ptr": "*fp32", "g_ptr": "*i64", "cnt_ptr": "*fp32", "sum_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    gm2 = {"x_ptr": "*fp32", "g_ptr": "*i64", "cnt_ptr": "*fp32", "sum_ptr": "*fp32", "m2_ptr": "*fp32", "n": "i32",
           "BLOCK": "constexpr"}
    return [
        (lp._fwd_kernel, fwd, {"BLOCK_V": 4096, "WITH_ENTROPY": True}),
        (lp._fwd_kernel, fwd, {"BLOCK_V": 4096, "WITH_ENTROPY": False}),
        (lp._bwd_kernel, bwd, {"BLOCK_V": 4096, "HAS_G_LP": True, "HAS_G_ENT": True}),
        (lp._bwd_kernel, bwd, {"BLOCK_V": 4096, "HAS_G_LP": False, "HAS_G_ENT": True}),
        (sc._reverse_scan_kernel, scan, {"BLOCK": 256}),
        (sc._gae_kernel, gae, {"BLOCK": 256}),
        (sc._group_sum_kernel, gsum, {"BLOCK": 256}),
        (sc._group_m2_kernel, gm2, {"BLOCK": 256}),
    ]


def test_triton_kernels_compile_for_sm90():
    """Compile every kernel to an sm_90 cubin without a GPU: catches errors the interpreter lets through."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: kernels are interpreted, not compiled")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")
    for kernel, signature, constexprs in _signatures():
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 8})
        assert compiled.asm.get("cubin"), f"{kernel} produced no cubin"
