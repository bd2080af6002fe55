"""tinyzero.host_memory: with the mmap threshold fixed (trainer.host_mmap_threshold_kb), memory a process frees
goes back to the system even when it is interleaved with live tensors; with glibc's adaptive default
it stays resident. Each case runs in a fresh interpreter (malloc settings are per process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tinyzero.host_memory import _glibc

SCRIPT = r"""
import json, sys, torch
from tinyzero.host_memory import set_mmap_threshold
def rss_mb():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) / 1024
ok = set_mmap_threshold(64 * 1024) if sys.argv[1] == "fixed" else None
big = torch.ones(4 * 2**20)  # 16 MiB, freed: glibc's adaptive threshold rises above 1 MiB
del big
blocks = [torch.ones(2**18) for _ in range(200)]  # 200 x 1 MiB, written (resident)
before = rss_mb()
del blocks[::2]  # every other one freed: holes between live blocks
print(json.dumps({"set": ok, "freed_mb": before - rss_mb()}))
"""


def _run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")
def test_fixed_mmap_threshold_returns_freed_memory():
    fixed, default = _run("fixed"), _run("default")
    assert fixed["set"] is True
    assert fixed["freed_mb"] >= 90, fixed  # the 100 freed MiB left the process
    assert default["freed_mb"] < 20, default  # glibc's default kept them (holes in its heap)
