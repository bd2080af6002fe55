"""Collectives for the native engine's tensor-parallel decode (rollout.tensor_model_parallel_size > 1).

A tensor-parallel decode step exchanges two small tensors per layer (the attention rows each rank
computed, the MLP's partial sums) and the vocabulary shards of the logits. On a CPU host gloo takes
about 1 ms for an all-gather and 2 ms for an all-reduce of a (16, 576) fp32 tensor, so 60 of them
would cost more than the step saves. Two implementations of the same three calls:

* `ShmComm` (tinyzero.distributed.shm_comm; CPU ranks of one x86 host): the ranks exchange through a shared memory
  segment; a handoff takes a few microseconds. A peer that does not arrive within `timeout_s` raises
  (it died or hangs), naming it.
* `DistComm`: torch.distributed collectives on the group (NCCL on GPU; gloo elsewhere).

`build_comm(group, device)` picks one. Every call is collective over the group, in the same order on
every rank; results are identical on every rank (an all-reduce adds the slots in rank order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyzero.distributed.shm_comm import ShmComm, intra_host_cpu_group

__all__ = ["DistComm", "ShmComm", "build_comm"]

TIMEOUT_S = 600.0


class DistComm:
    """torch.distributed collectives over `group`."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def reserve(self, nbytes: int) -> None:
        """Room for exchanges of up to `nbytes` per rank (nothing to do here)."""

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank -> (size, n, ...), rank k's tensor at [k]."""
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


def build_comm(group, device: torch.device, nbytes: int = 1 << 20):
    """ShmComm for CPU ranks of one x86 host, else DistComm."""
    if intra_host_cpu_group(group, device):
        return ShmComm(group, nbytes, timeout_s=TIMEOUT_S, what="tensor-parallel decode")
    return DistComm(group)
