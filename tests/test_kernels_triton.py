"""Runs the Triton kernel tests (test_kernels_triton_cases.py) under the CPU interpreter.

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
