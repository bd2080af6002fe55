"""The process's host memory: glibc's mmap threshold, and handing freed memory back to the system.

glibc's malloc serves a block below its mmap threshold from heaps it keeps, and the threshold
rises by itself (up to 32 MiB) each time a larger mapped block is freed. A training process soon
allocates most tensors of a step (activations, gradients, generation's temporaries, MBs each) from
those heaps; what a phase frees stays resident and fragmented, so the peak resident size of a step
is well above what is live at any time. `set_mmap_threshold` fixes the threshold
(trainer.host_mmap_threshold_kb, off by default): every larger tensor gets its own mapping, returned
to the system when freed, and resident memory follows the live tensors. The price is a fresh mapping
(page faults) per large allocation: next to a real model's matmuls it is small, but a tiny model's
step, made of many cheap ops on MB-sized tensors, slows by half (the CPU tools demo's warm-up, separate
runs: 0.22 -> 0.33 s per step at 64 KiB). Measured on SmolLM2-135M, bf16 (bench/RESULTS.md): peak RSS per rank
3537 MiB with glibc's default, 2530 MiB at 1024 KiB, 2474 MiB at 64 KiB.

Both calls do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


@functools.lru_cache(maxsize=1)
def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def set_mmap_threshold(nbytes: int) -> bool:
    """Blocks of at least `nbytes` get their own mapping (and the threshold stops adapting); True if set."""
    libc = _glibc()
    return bool(libc is not None and nbytes > 0 and libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)) == 1)


def release_freed_memory(device=None) -> None:
    """Hand freed memory back to the system: the CUDA caching allocator's blocks on a CUDA device, and
    the C library's free heap pages (malloc_trim) otherwise."""
    if device is not None and getattr(device, "type", str(device)) == "cuda":
        import torch

        torch.cuda.empty_cache()
        return
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
