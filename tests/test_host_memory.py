"""tinyzero.runtime.host_memory: with the mmap threshold fixed (tuning.host_mmap_threshold_kb), memory a process frees
goes back to the system even when it is interleaved with live tensors; with glibc's adaptive default
it stays resident until a phase ends with more than tuning.host_trim_threshold_mb free in the heaps
(phase_done). Each case runs in a fresh interpreter (malloc settings are per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tinyzero.runtime.host_memory import _glibc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRIM_SCRIPT = r"""
import json, torch
from tinyzero.runtime.host_memory import free_heap_bytes, phase_done, set_trim_threshold
def rss_mb():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) / 1024
big = torch.ones(4 * 2**20)  # 16 MiB, freed: glibc's adaptive threshold rises above 1 MiB
del big
blocks = [torch.ones(2**18) for _ in range(200)]  # 200 x 1 MiB from the heap, written (resident)
del blocks[::2]  # every other one freed: holes between live blocks
free_mb, before = free_heap_bytes() / 2**20, rss_mb()
set_trim_threshold(0)
off = phase_done()
set_trim_threshold(2**30)  # 1 GiB: more than the heaps hold free
high = phase_done()
after_high = rss_mb()
set_trim_threshold(64 * 2**20)
trimmed = phase_done()
live_sum = float(sum(b.sum() for b in blocks))  # the live blocks are intact
print(json.dumps({"free_mb": free_mb, "off": off, "high": high, "kept_mb": before - after_high,
                  "trimmed": trimmed, "freed_mb": before - rss_mb(), "live_sum": live_sum}))
"""

SCRIPT = r"""
import json, sys, torch
from tinyzero.runtime.host_memory import set_mmap_threshold
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


def _run(mode: str, script: str = SCRIPT, huge_pages: bool = False) -> dict:
    # Huge pages off unless asked for: the counts below are of 4 KiB pages and glibc's own placement.
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1" if huge_pages else "0"}
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120,
                         check=True, env=env, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")
def test_fixed_mmap_threshold_returns_freed_memory():
    fixed, default = _run("fixed"), _run("default")
    assert fixed["set"] is True
    assert fixed["freed_mb"] >= 90, fixed  # the 100 freed MiB left the process
    assert default["freed_mb"] < 20, default  # glibc's default kept them (holes in its heap)


@pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"), reason="needs glibc >= 2.33")
def test_phase_done_trims_only_above_the_threshold():
    r = _run("trim", TRIM_SCRIPT)
    assert 95 <= r["free_mb"] <= 110, r  # the 100 freed MiB (plus the allocator's own slack)
    assert r["off"] is False and r["high"] is False, r  # off, or fewer free bytes than the threshold
    assert r["kept_mb"] < 5, r  # ... and nothing left the process
    assert r["trimmed"] is True, r
    assert r["freed_mb"] >= 90, r  # the holes' pages went back to the system
    assert r["live_sum"] == 100 * 2**18, r


KEEP_SCRIPT = r"""
import json, resource, sys, torch
from tinyzero.runtime.host_memory import free_heap_bytes, keep_freed_memory, phase_done, release_freed_memory, set_trim_threshold
def rss_mb():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) / 1024
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ok = keep_freed_memory() if sys.argv[1] == "keep" else None
set_trim_threshold(1)  # phase_done would trim any free byte
a = torch.ones(16 * 2**20)  # 64 MiB, above glibc's largest adaptive mmap threshold (32 MiB)
del a
f0 = faults()
b = torch.ones(15 * 2**20)  # 60 MiB, written: fits in the freed block's pages
refault = faults() - f0
del b
before = rss_mb()
trimmed = phase_done()
release_freed_memory()
print(json.dumps({"set": ok, "refault_pages": refault, "trimmed": trimmed, "freed_mb": before - rss_mb(),
                  "free_mb": free_heap_bytes() / 2**20}))
"""


@pytest.mark.slow
@pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"), reason="needs glibc >= 2.33")
def test_keep_freed_memory_reuses_pages_instead_of_faulting():
    keep, default = _run("keep", KEEP_SCRIPT), _run("default", KEEP_SCRIPT)
    pages = 60 * 2**20 // 4096
    # glibc's default maps a block of 32 MiB or more afresh each time: every page faults when written.
    assert default["refault_pages"] >= 0.9 * pages, default
    # Kept, the second block reuses the first one's pages from the heap.
    assert keep["set"] is True and keep["refault_pages"] < 0.05 * pages, keep
    # Nothing is trimmed while kept: the freed 60 MiB stay resident and free in the heap.
    assert keep["trimmed"] is False and keep["freed_mb"] < 5 and keep["free_mb"] >= 59, keep


def test_keep_freed_memory_conflicts_with_the_mmap_threshold():
    from tinyzero.config import ConfigError
    from tinyzero.config.tuning import TuningConfig

    with pytest.raises(ConfigError, match="host_keep_freed_memory"):
        TuningConfig(host_keep_freed_memory=True, host_mmap_threshold_kb=1024)


THP_SCRIPT = r"""
import json, os, resource, sys
if sys.argv[1] == "train":
    os.environ.pop("THP_MEM_ALLOC_ENABLE")
    import train  # noqa: F401  (the entry point sets the allocator's switch before torch is imported)
import torch
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(8 * 2**20)  # 32 MiB, written
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(json.dumps({"env": os.environ.get("THP_MEM_ALLOC_ENABLE"), "aligned": x.data_ptr() % 4096 == 0,
                  "faults": faults}))
"""


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "none"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_train_entry_point_turns_on_huge_pages_for_large_blocks():
    on, off = _run("train", THP_SCRIPT, huge_pages=True), _run("off", THP_SCRIPT)
    assert on["env"] == "1" and off["env"] == "0"
    assert on["aligned"] is True, on  # PyTorch's huge-page path page-aligns the block
    assert off["aligned"] is False, off  # glibc's own mapping: a 16-byte header before the data
    assert off["faults"] >= 0.9 * (32 * 2**20 // 4096), off  # one fault per 4 KiB page
    if _thp_mode() in ("always", "madvise"):
        assert on["faults"] < 0.25 * off["faults"], (on, off)  # 2 MiB pages where the kernel had them
