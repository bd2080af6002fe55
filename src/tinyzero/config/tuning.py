"""The `tuning` section: knobs of tinyzero's own machinery, apart from the user's settings.

Nothing here changes what a run computes, only how fast and in how much memory; the defaults suit a
run nobody tuned. A setting belongs here when a user of veRL or TRL would not expect to see it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TuningConfig"]


@dataclass
class TuningConfig:
    """Host memory of the training processes (glibc malloc; tinyzero.runtime.host_memory)."""

    host_trim_threshold_mb: int = 256
    """At the end of each phase of a step (generation, log-probs, update, ...), when the host heaps hold
    more than this many MiB free, their free pages go back to the system (malloc_trim), so what one phase
    freed does not stay resident under the next one's peak. 0 turns it off."""
    host_mmap_threshold_kb: int = 0
    """Host allocations of at least this many KiB get their own mapping, returned to the system when
    freed, so resident memory follows the live tensors (e.g. 1024); every such allocation then pays page
    faults. 0 (default) leaves glibc's adaptive threshold."""
    host_keep_freed_memory: bool | None = None
    """Speed over memory: every host allocation comes from the heaps, which never shrink, and nothing is
    trimmed (host_trim_threshold_mb is ignored), so each phase reuses the pages earlier phases freed
    instead of faulting in fresh ones; the peak resident memory is higher. Cannot be combined with
    host_mmap_threshold_kb. None: on for runs on the CPU (trainer.device=cpu, or auto on a host without a
    GPU) unless host_mmap_threshold_kb is set; off on GPU hosts, where the host heaps are not the bottleneck."""

    shm_collectives: bool | None = None
    """CPU ranks of one x86 host: FSDP2's all-gathers and reduce-scatters (every role's model) go through a
    shared-memory segment (tinyzero.distributed.shm_comm) instead of gloo's TCP loopback; same results, fewer
    copies. Ignored for ranks on several hosts. None: on for runs on the CPU, off on GPU hosts (NCCL)."""

    def use_shm_collectives(self, on_cpu: bool) -> bool:
        """Whether the run routes CPU FSDP2 collectives through shared memory (shm_collectives, or its default)."""
        return on_cpu if self.shm_collectives is None else self.shm_collectives

    def keep_freed_memory(self, on_cpu: bool) -> bool:
        """Whether the run keeps freed host memory (host_keep_freed_memory, or its default for the device)."""
        if self.host_keep_freed_memory is not None:
            return self.host_keep_freed_memory
        return on_cpu and self.host_mmap_threshold_kb == 0

    def __post_init__(self):
        from tinyzero.config.root import ConfigError

        for name in ("host_mmap_threshold_kb", "host_trim_threshold_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"tuning.{name} must be >= 0 (got {getattr(self, name)})")
        if self.host_keep_freed_memory and self.host_mmap_threshold_kb > 0:
            raise ConfigError(f"tuning.host_keep_freed_memory keeps freed host memory for reuse and "
                              f"tuning.host_mmap_threshold_kb={self.host_mmap_threshold_kb} hands it back; "
                              "set one of them")
