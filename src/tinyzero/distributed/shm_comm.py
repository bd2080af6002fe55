"""Collectives through shared memory for the CPU ranks of one host.

gloo moves every byte through TCP loopback: an FSDP2 all-gather of a 13 MiB layer costs the kernel's
socket copies on both sides plus two 13 MiB staging copies inside gloo, and a reduce-scatter a 13 MiB
clone; a (16, 576) all-gather for a tensor-parallel decode step takes about 1 ms. The ranks of one host
can instead exchange through a segment they all map.

* `ShmComm`: the segment and its handshake. Each rank writes its slot, then bumps its sequence number;
  a reader waits for every peer's number, then reads their slots (x86 keeps stores in program order and
  loads in program order, so a slot written before the number is whole when the number is seen). Two
  buffers alternate, so a rank writes the next exchange while a slow peer still reads the last one.
  Exchanges larger than a slot go through it in pieces. A waiting rank checks about once a second that
  the peers' processes still run (their pids are in the segment) and raises at once, naming the rank,
  when one is gone; a peer that lives but does not arrive within `timeout_s` raises too (it hangs): no
  collective here waits forever.
* `ShmAllGather` / `ShmReduceScatter`: FSDP2's custom-collective hooks (`FSDPModule.set_custom_all_gather`
  and `set_custom_reduce_scatter`) on a `ShmComm`. `use_shm_collectives(modules, group)` installs them
  when `intra_host_cpu_group(group)`; any other group, or a reduction other than sum / average, falls
  back to torch.distributed.

Every call is collective over the group, in the same order on every rank (SPMD). Results are identical
to gloo's: an all-gather moves bytes, and a reduction adds the ranks' parts in rank order.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
import uuid
from typing import Callable, Sequence

import torch
import torch.distributed as dist

try:  # FSDP2's custom-collective hook types: a private module that only recent torch has (checked on 2.11-2.13)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    FSDP_HOOKS = True
except ImportError:  # older torch: FSDP2 keeps its own collectives; the rest of this module still works
    FSDP_HOOKS = False

    class AllGather:  # noqa: D101 - stand-in base, never handed to FSDP2
        pass

    class ReduceScatter:  # noqa: D101
        pass

_X86 = ("x86_64", "amd64", "i386", "i686", "x86")
_CACHE_LINE = 64


def intra_host_cpu_group(group, device: torch.device) -> bool:
    """True when every rank of `group` is a CPU process on this x86 host (a collective call)."""
    if device.type != "cpu" or platform.machine().lower() not in _X86 or dist.get_world_size(group) < 2:
        return False
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, platform.node(), group=group)
    return len(set(hosts)) == 1


class ShmComm:
    """The ranks of `group`, on one host, exchanging through shared memory (see module docstring).

    `nbytes`: a slot's size per rank (grown by `reserve`, or used in pieces by the `*_into` calls);
    `what`: who uses it, for the error a missing peer raises."""

    def __init__(self, group, nbytes: int = 1 << 20, timeout_s: float = 600.0, what: str = "shared-memory exchange"):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self.what = what
        self.capacity = 0
        self._seq = 0
        self._map(nbytes)

    def _map(self, nbytes: int) -> None:
        """(Re)create the segment with `nbytes` per rank slot: rank 0 creates the file and names it to the
        others, every rank maps it, then the file is unlinked (the mappings stay; nothing is left behind
        when a process dies)."""
        nbytes = -(-int(nbytes) // _CACHE_LINE) * _CACHE_LINE
        header = _CACHE_LINE * self.size  # one sequence number per cache line
        total = header + 2 * self.size * nbytes
        name = [None]
        if self.rank == 0:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
            name[0] = os.path.join(folder, f"tinyzero-shm-{os.getpid()}-{uuid.uuid4().hex[:8]}")
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
        self._flags = mem[:header].view(torch.int64).numpy()  # rank k's number at [8 * k], its pid at [8 * k + 1]
        self._slots = mem[header:].view(2, self.size, nbytes)
        self.capacity = nbytes
        self._seq = 0
        self._flags[8 * self.rank + 1] = os.getpid()
        dist.barrier(group=self.group)  # every pid written
        # 0: a peer whose pid this process cannot see (another pid namespace) is not checked
        self._pids = [pid if _running(pid) else 0 for pid in (int(self._flags[8 * k + 1]) for k in range(self.size))]

    def reserve(self, nbytes: int) -> None:
        """Room for exchanges of up to `nbytes` per rank: a collective call (every rank asks the same)."""
        if nbytes > self.capacity:
            self._mem = self._flags = self._slots = None
            self._map(max(nbytes, 2 * self.capacity))

    def _wait(self, seq: int) -> None:
        flags, spins, start, checked = self._flags, 0, None, 0.0
        for k in range(self.size):
            while flags[8 * k] < seq:
                spins += 1
                if spins > 2000:
                    os.sched_yield()  # a peer sharing this core gets to run
                if spins % 4096 == 0:
                    now = time.monotonic()
                    start = start or now
                    if now - start > self.timeout_s:
                        raise RuntimeError(
                            f"{self.what}: rank {self.rank} waited {self.timeout_s:.0f} s for rank {k} of its group "
                            f"at exchange {seq}; that rank died or is stuck")
                    if now - checked > 1.0 and self._pids[k]:
                        checked = now
                        if not _running(self._pids[k]):
                            raise RuntimeError(f"{self.what}: rank {k} of the group (pid {self._pids[k]}) exited while "
                                               f"rank {self.rank} waited for it at exchange {seq}")

    def exchange(self, nbytes: int, write: Callable[[torch.Tensor], object]) -> torch.Tensor:
        """One exchange: `write(slot)` fills this rank's (nbytes,) uint8 slot; returns every rank's slot,
        (size, nbytes) uint8, readable until this rank's next exchange."""
        if nbytes > self.capacity:
            raise ValueError(f"ShmComm: a {nbytes}-byte exchange exceeds the reserved {self.capacity} bytes")
        seq = self._seq = self._seq + 1
        self._wait(seq - 1)  # every peer is past the exchange that last used this buffer
        slots = self._slots[seq % 2]
        write(slots[self.rank, :nbytes])
        self._flags[8 * self.rank] = seq
        self._wait(seq)
        return slots[:, :nbytes]

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank -> (size, n, ...), rank k's tensor at [k] (a new tensor)."""
        slots = self.exchange(x.numel() * x.element_size(), lambda mine: _typed(mine, x).copy_(x))
        return slots.view(x.dtype).view(self.size, *x.shape).clone()

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks into x (rank order)."""
        parts = self.all_gather(x)
        torch.sum(parts, dim=0, out=x) if self.size > 2 else torch.add(parts[0], parts[1], out=x)
        return x

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """torch.distributed.all_gather_into_tensor for flat contiguous tensors: rank k's `input` lands at
        output[k * n:(k + 1) * n]. `input` may be that slice of `output` already (FSDP2's copy-in)."""
        src, dst = _bytes(input), _bytes(output)
        n = src.numel()
        if dst.numel() != n * self.size:
            raise ValueError(f"all_gather_into: output has {dst.numel()} bytes, expected {self.size} x {n}")
        own = dst[self.rank * n:(self.rank + 1) * n]
        if own.data_ptr() != src.data_ptr():
            own.copy_(src)
        for c0 in range(0, n, self.capacity):
            m = min(self.capacity, n - c0)
            slots = self.exchange(m, lambda mine: mine.copy_(src[c0:c0 + m]))  # noqa: B023 - called at once
            for k in range(self.size):
                if k != self.rank:
                    dst[k * n + c0:k * n + c0 + m].copy_(slots[k])

    def reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor, average: bool = False) -> None:
        """torch.distributed.reduce_scatter_tensor (sum, or average) for flat contiguous tensors: output on
        rank r = sum over ranks k of input_k[r * n:(r + 1) * n], added in rank order."""
        n = output.numel()
        if input.numel() != n * self.size or input.dtype != output.dtype:
            raise ValueError(f"reduce_scatter_into: input {input.numel()} x {input.dtype}, output {n} x {output.dtype}")
        parts = input.view(self.size, n)
        step = max(1, self.capacity // (self.size * input.element_size()))
        others = [k for k in range(self.size) if k != self.rank]

        def write(mine, c0, m):
            blocks = mine.view(input.dtype).view(self.size, m)
            for j in others:  # the blocks the peers reduce; this rank's own block is read in place
                blocks[j].copy_(parts[j, c0:c0 + m])

        for c0 in range(0, n, step):
            m = min(step, n - c0)
            slots = self.exchange(self.size * m * input.element_size(), lambda mine: write(mine, c0, m))  # noqa: B023
            theirs = slots.view(input.dtype).view(self.size, self.size, m)[:, self.rank]  # (size, m): from rank k
            out = output[c0:c0 + m]
            terms = [parts[self.rank, c0:c0 + m] if k == self.rank else theirs[k] for k in range(self.size)]
            torch.add(terms[0], terms[1], out=out)
            for t in terms[2:]:
                out.add_(t)
        if average:
            output.div_(self.size)


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _typed(slot: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return slot.view(like.dtype).view(like.shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("shared-memory collectives take contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------- FSDP2 hooks


class _ShmCollective:
    """FSDP2's custom-collective hook on `comm`: fresh output buffers (FSDP2 keeps them past the call)."""

    def __init__(self, comm: ShmComm):
        self.comm = comm

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class ShmAllGather(_ShmCollective, AllGather):
    """FSDP2 all-gather through `comm` (its group only; another group goes to torch.distributed)."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if group is not self.comm.group:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        self.comm.all_gather_into(output_tensor, input_tensor)
        return None  # done: FSDP2 waits on a Work only when one is returned


class ShmReduceScatter(_ShmCollective, ReduceScatter):
    """FSDP2 reduce-scatter (sum or average) through `comm`; other reductions go to torch.distributed."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        kind = op if isinstance(op, dist.ReduceOp.RedOpType) else None
        if group is not self.comm.group or kind not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        self.comm.reduce_scatter_into(output_tensor, input_tensor, average=kind == dist.ReduceOp.AVG)
        return None


_COMMS: dict = {}  # process group -> the ShmComm its FSDP2 modules use (one segment per group)
_ENABLED: list[bool] = [True]


def enable_shm_collectives(on: bool) -> None:
    """Whether FSDP2 models of this process route their collectives through shared memory where they can
    (tuning.shm_collectives; train.py sets it once, before any model is wrapped)."""
    _ENABLED[0] = bool(on)


def shm_collectives_enabled() -> bool:
    return _ENABLED[0]


def comm_for(group) -> ShmComm | None:
    """The segment `use_shm_collectives` set up for `group`, or None (then use torch.distributed)."""
    return _COMMS.get(group)


_WARNED: list[bool] = []


def _warn_no_hooks() -> None:
    if not _WARNED:
        _WARNED.append(True)
        import warnings

        warnings.warn(f"tuning.shm_collectives is ignored: torch {torch.__version__} has no FSDP2 custom-"
                      "collective hooks (set_custom_all_gather); FSDP2 uses torch.distributed", stacklevel=3)


def use_shm_collectives(modules, group, device: torch.device, timeout_s: float,
                        slot_bytes: int = 4 << 20) -> ShmComm | None:
    """Route the FSDP2 modules' all-gathers and reduce-scatters over `group` through one shared segment
    when the group is CPU ranks of one x86 host (a collective call); return the comm, or None (nothing
    changed). `slot_bytes`: the piece each rank writes per handshake (the segment holds 2 x ranks of them).
    The models of one group (actor, reference, critic) share its segment; `comm_for(group)` finds it."""
    if not FSDP_HOOKS or not all(hasattr(m, "set_custom_all_gather") for m in modules):
        if torch.device(device).type == "cpu":
            _warn_no_hooks()
        return None
    comm = _COMMS.get(group)
    if comm is None:
        if not intra_host_cpu_group(group, device):
            return None
        comm = _COMMS[group] = ShmComm(group, slot_bytes, timeout_s=timeout_s, what="FSDP collective")
    all_gather, reduce_scatter = ShmAllGather(comm), ShmReduceScatter(comm)
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
    return comm
