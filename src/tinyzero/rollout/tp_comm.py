"""Collectives for the native engine's tensor-parallel decode (rollout.tensor_model_parallel_size > 1).

A tensor-parallel decode step exchanges two small tensors per layer (the attention rows each rank
computed, the MLP's partial sums) and the vocabulary shards of the logits. On a CPU host gloo takes
about 1 ms for an all-gather and 2 ms for an all-reduce of a (16, 576) fp32 tensor, so 60 of them
would cost more than the step saves. Two implementations of the same three calls:

* `ShmComm` (CPU, x86): the ranks of one host exchange through a shared memory segment. Each rank
  writes its slot, then bumps its sequence number; a reader waits for every peer's number, then
  reads their slots (x86 keeps stores in program order and loads in program order, so a slot
  written before the number is whole when the number is seen). Two buffers alternate, so a rank
  writes the next exchange while a slow peer still reads the last one. A handoff takes a few
  microseconds. A peer that does not arrive within `timeout_s` raises (it died or hangs), naming it.
* `DistComm`: torch.distributed collectives on the group (NCCL on GPU; gloo elsewhere).

`build_comm(group, device)` picks one. Every call is collective over the group, in the same order on
every rank; results are identical on every rank (an all-reduce adds the slots in rank order).
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
import uuid

import torch
import torch.distributed as dist

TIMEOUT_S = 600.0
_X86 = ("x86_64", "amd64", "i386", "i686", "x86")


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


class ShmComm:
    """The ranks of `group`, on one host, exchanging through shared memory (see module docstring)."""

    def __init__(self, group, nbytes: int = 1 << 20, timeout_s: float = TIMEOUT_S):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self.capacity = 0
        self._seq = 0
        self._map(nbytes)

    def _map(self, nbytes: int) -> None:
        """(Re)create the segment with `nbytes` per rank slot: rank 0 creates the file and names it to the
        others, every rank maps it, then the file is unlinked (the mappings stay)."""
        nbytes = -(-int(nbytes) // 64) * 64
        header = 64 * self.size  # one sequence number per cache line
        total = header + 2 * self.size * nbytes
        name = [None]
        if self.rank == 0:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
            name[0] = os.path.join(folder, f"tinyzero-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            with open(name[0], "wb") as f:
                f.truncate(total)
        dist.broadcast_object_list(name, group=self.group, group_src=0)
        try:
            mem = torch.from_file(name[0], shared=True, size=total, dtype=torch.uint8)
        finally:
            dist.barrier(group=self.group)
            if self.rank == 0:
                os.unlink(name[0])
        self._mem = mem
        self._flags = mem[:header].view(torch.int64).numpy()  # rank k's number at [8 * k]
        self._slots = mem[header:].view(2, self.size, nbytes)
        self.capacity = nbytes
        self._seq = 0

    def reserve(self, nbytes: int) -> None:
        """Room for exchanges of up to `nbytes` per rank: a collective call (every rank asks the same)."""
        if nbytes > self.capacity:
            self._mem = self._flags = self._slots = None
            self._map(max(nbytes, 2 * self.capacity))

    def _wait(self, seq: int) -> None:
        flags, spins, start = self._flags, 0, None
        for k in range(self.size):
            while flags[8 * k] < seq:
                spins += 1
                if spins > 2000:
                    os.sched_yield()  # a peer sharing this core gets to run
                if spins % 4096 == 0:
                    start = start or time.monotonic()
                    if time.monotonic() - start > self.timeout_s:
                        raise RuntimeError(
                            f"tensor-parallel decode: rank {self.rank} waited {self.timeout_s:.0f} s for rank {k} of "
                            f"its rollout group at exchange {seq}; that rank died or is stuck")

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank -> (size, n, ...), rank k's tensor at [k]."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.capacity:
            raise ValueError(f"ShmComm: a {nbytes}-byte exchange exceeds the reserved {self.capacity} bytes")
        seq = self._seq = self._seq + 1
        self._wait(seq - 1)  # every peer is past the exchange that last used this buffer
        slots = self._slots[seq % 2]
        slots[self.rank, :nbytes].view(x.dtype).view(x.shape).copy_(x)
        self._flags[8 * self.rank] = seq
        self._wait(seq)
        return slots[:, :nbytes].view(x.dtype).view(self.size, *x.shape).clone()

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.all_gather(x)
        torch.sum(parts, dim=0, out=x) if self.size > 2 else torch.add(parts[0], parts[1], out=x)
        return x


def build_comm(group, device: torch.device, nbytes: int = 1 << 20):
    """ShmComm for CPU ranks of one x86 host, else DistComm."""
    if device.type != "cpu" or platform.machine().lower() not in _X86:
        return DistComm(group)
    ranks = dist.get_process_group_ranks(group)
    hosts = [None] * len(ranks)
    dist.all_gather_object(hosts, platform.node(), group=group)
    if len(set(hosts)) > 1:
        return DistComm(group)
    return ShmComm(group, nbytes)

