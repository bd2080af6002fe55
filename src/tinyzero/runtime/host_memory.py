"""The process's host memory: handing what a phase freed back to the system, glibc's mmap threshold,
or keeping every freed page for reuse.

glibc's malloc serves a block below its mmap threshold from heaps it keeps, and the threshold
rises by itself (up to 32 MiB) each time a larger mapped block is freed. A training process soon
allocates most tensors of a step (activations, gradients, generation's temporaries, MBs each) from
those heaps; what a phase frees stays resident and fragmented, so the peak resident size of a step
is well above what is live at any time. Two remedies, both host-side only:

- `phase_done` (trainer.host_trim_threshold_mb, default 256): at the end of each timed phase of a
  step, when the heaps hold more than the threshold free, `malloc_trim` hands their free pages back.
  The next phase faults in again only the pages it reuses, once; a small model, whose heaps never
  hold that much free, is untouched.
- `set_mmap_threshold` (trainer.host_mmap_threshold_kb, off by default): every larger block gets its
  own mapping, returned to the system when freed, so resident memory follows the live tensors most
  closely. The price is a fresh, zeroed mapping at every large allocation (about 0.9 ms per MiB in a
  VM: 2.1 s for 300 x 8 MiB against 0.06 s from the heap), on every activation of every step.

The opposite trade, for speed: `keep_freed_memory` (trainer.host_keep_freed_memory) serves every
block from the heaps (no block gets its own mapping: those, 32 MiB and more with glibc's default,
are fresh pages at every allocation), glibc never shrinks them, and nothing is trimmed. A phase then
reuses the pages the previous phases freed instead of faulting in new, zeroed ones. On a VM the page
faults of a SmolLM2 fp32 update (about 850k a step per rank, most of its system time) cost a quarter
of its time; kept, they fall to about 30k, at the price of a higher peak.

Measured on SmolLM2-135M, bf16, one GRPO step per rank (bench/RESULTS.md): peak RSS 3525-3888 MiB
with neither, 3045-3108 MiB trimming at phase ends (same step time), 2555-2566 MiB with the 1024 KiB
threshold (step time +25%). fp32, our side alone, interleaved (with sleep_level 2 and fused layers):
trimming at phase ends 29.1 / 40.5 s a step (update 18.8 / 25.3 s), 4127-4184 MiB; kept 24.8 / 25.5 s
(update 13.5 / 14.6 s), 5025-5055 MiB.

Huge pages, under all three: train.py sets THP_MEM_ALLOC_ENABLE=1 (PyTorch's own switch, read at
torch's first allocation) unless it is set already. PyTorch then page-aligns every block of 2 MiB
and more and asks for transparent huge pages on it (madvise; the kernel's default "madvise" mode
honours it, "never" ignores it): a fault maps 2 MiB instead of 4 KiB. Measured, it also keeps much
less free memory resident in the heaps under a step's peak. SmolLM2-135M fp32, GRPO at the vs_trl
shape, our side alone (tensor-parallel rollout, sleep_level 2, fused layers), peak RSS per rank:
kept 4666-4709 MiB without, 3537-3543 MiB with (step time unchanged within the noise); trimming at
phase ends 4305 MiB without, 3389 MiB with.

All calls do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


class _MallInfo2(ctypes.Structure):  # struct mallinfo2 (malloc.h, glibc >= 2.33)
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


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


_keep = False


def keep_freed_memory() -> bool:
    """From now on every block comes from glibc's heaps, which never shrink, and `phase_done` and
    `release_freed_memory` leave host memory alone; True if glibc took the settings."""
    global _keep
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, _INT_MAX) == 1
    _keep = _keep or ok
    return ok


def release_freed_memory(device=None) -> None:
    """Hand freed memory back to the system: the CUDA caching allocator's blocks on a CUDA device, and
    the C library's free heap pages (malloc_trim) otherwise, unless `keep_freed_memory` is on."""
    if device is not None and getattr(device, "type", str(device)) == "cuda":
        import torch

        torch.cuda.empty_cache()
        return
    libc = _glibc()
    if libc is not None and not _keep:
        libc.malloc_trim(0)


def free_heap_bytes() -> int | None:
    """Bytes the C library's heaps hold free (all arenas), resident or not; None without glibc >= 2.33."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.fordblks + info.fsmblks)


_trim_threshold_bytes = 0


def set_trim_threshold(nbytes: int) -> None:
    """`phase_done` trims when the heaps hold at least `nbytes` free; 0 turns it off."""
    global _trim_threshold_bytes
    _trim_threshold_bytes = max(0, int(nbytes))


def phase_done() -> bool:
    """End of a phase of a step: hand the heaps' free pages back when they hold more than the threshold
    set by `set_trim_threshold`; True if they were trimmed."""
    if _trim_threshold_bytes <= 0 or _keep:
        return False
    free = free_heap_bytes()
    if free is None or free < _trim_threshold_bytes:
        return False
    _glibc().malloc_trim(0)
    return True
