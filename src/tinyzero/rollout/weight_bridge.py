"""Weights from the trainer pool to a rollout pool on other ranks: a bucketed broadcast.

The asynchronous pipeline (tinyzero.trainer.async_pipeline) keeps the rollout engine on ranks
that hold no actor. After each actor update the trainer pool streams the full parameters
(`full_params.iter_full_params`: every trainer rank takes part in the FSDP gathers) and the
trainer pool's first rank broadcasts them over a "bridge" process group made of itself and the
rollout ranks (gloo on CPU, NCCL on GPU). A bucket travels as one header object (names, shapes,
dtypes) and one flat byte buffer; a `None` header ends the stream. The rollout ranks rebuild the
tensors and hand them to `engine.update_weights`.

    open_bridge([0, 2, 3])                            # every rank of the world, in the driver
    send_params(stream, bridge_group(ranks), src=0, send=rank == 0, bucket_bytes=...)   # trainer pool
    engine.update_weights(receive_params(bridge_group(ranks), src=0, device=device))    # rollout pool
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from tinyzero.distributed import on_cleanup

__all__ = ["open_bridge", "bridge_group", "send_params", "receive_params", "checksum", "tensor_sum", "announce",
           "BridgeSource"]

_BRIDGES: dict[tuple[int, ...], object] = {}
on_cleanup(_BRIDGES.clear)  # the groups are freed (their threads joined) by cleanup()


def open_bridge(ranks: list[int]) -> None:
    """Create the bridge group over `ranks`. Collective over the whole world (dist.new_group):
    every rank calls it, in the same order, before any worker uses the group."""
    from tinyzero.single_controller.failure import collective_timeout_s

    key = tuple(int(r) for r in ranks)
    if key not in _BRIDGES:
        _BRIDGES[key] = dist.new_group(list(key), timeout=timedelta(seconds=collective_timeout_s()),
                                       group_desc="weight_bridge")


def bridge_group(ranks: list[int]):
    """The group open_bridge(ranks) created."""
    key = tuple(int(r) for r in ranks)
    if key not in _BRIDGES:
        raise ValueError(f"no weight bridge over ranks {list(key)}: call open_bridge({list(key)}) on every rank first")
    return _BRIDGES[key]


_SUM_CHUNK = 1 << 20  # elements per float64 partial sum: 8 MiB of float64 at a time, never a whole copy


def tensor_sum(t: torch.Tensor) -> float:
    """The tensor's sum accumulated in float64, a chunk at a time (a float64 copy of a whole embedding
    would double its memory)."""
    flat = t.detach().reshape(-1)
    return float(sum(flat[i:i + _SUM_CHUNK].sum(dtype=torch.float64) for i in range(0, flat.numel(), _SUM_CHUNK)))


def checksum(named: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Sum of every tensor's float64 sum (a cheap fingerprint of a set of weights)."""
    return float(sum(tensor_sum(t) for _, t in named))


def _padding(nbytes: int) -> int:
    return -nbytes % 8


def _send_bucket(parts: list, group, src: int) -> None:
    header = [[(name, shape, dtype) for name, shape, dtype, _ in parts]]
    dist.broadcast_object_list(header, src=src, group=group)
    flat = torch.cat([raw for *_, raw in parts])
    dist.broadcast(flat, src=src, group=group)


def send_params(stream: Iterator[tuple[str, torch.Tensor]], group, src: int, send: bool, bucket_bytes: int,
                dtype: torch.dtype | None = None) -> float:
    """Drain `stream` (every trainer rank must: it gathers shards); the sending rank broadcasts it
    in buckets of about `bucket_bytes`, floating-point tensors cast to `dtype` when given (the engine's:
    a bf16 engine receives half the bytes of fp32 master weights). Returns the checksum of what was
    sent (0.0 where send is False)."""
    if not send:
        for _ in stream:
            pass
        return 0.0
    parts, size, total = [], 0, 0.0
    for name, tensor in stream:
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        total += tensor_sum(tensor)
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        # a copy of its own (the stream may reuse its buffers), every tensor starting 8-byte aligned
        raw = torch.cat([raw, raw.new_zeros(_padding(raw.numel()))])
        shape, kind = tuple(tensor.shape), tensor.dtype
        del tensor
        if parts and size + raw.numel() > bucket_bytes:
            _send_bucket(parts, group, src)
            parts, size = [], 0
        parts.append((name, shape, kind, raw))
        size += raw.numel()
    if parts:
        _send_bucket(parts, group, src)
    dist.broadcast_object_list([None], src=src, group=group)
    return total


def receive_params(group, src: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs as the sending rank broadcasts them, one bucket at a time."""
    while True:
        header = [None]
        dist.broadcast_object_list(header, src=src, group=group)
        if header[0] is None:
            return
        sizes = [int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
                 for _, shape, dtype in header[0]]
        flat = torch.empty(sum(n + _padding(n) for n in sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for (name, shape, dtype), nbytes in zip(header[0], sizes):
            yield name, flat[offset:offset + nbytes].view(dtype).reshape(shape)
            offset += nbytes + _padding(nbytes)


# ---------------------------------------------------------------------------------------------- partial rollouts
def _ready_key(ranks: list[int], version: int) -> str:
    return f"weight_bridge/{'-'.join(map(str, ranks))}/ready/{version}"


def announce(ranks: list[int], version: int) -> None:
    """The sending rank, right before send_params: weights `version` are on their way over the bridge
    (a flag in the job's store that a rollout rank reads between decoding segments without blocking)."""
    from tinyzero.single_controller.failure import control_store

    store = control_store()
    if store is None:
        raise RuntimeError("weight_bridge.announce: the job's store is unreachable; partial rollouts need it")
    store.set(_ready_key(ranks, version), "1")
    if version > 0:  # every rollout rank took version - 1 before this one could be sent
        try:
            store.delete_key(_ready_key(ranks, version - 1))
        except Exception:  # noqa: BLE001 - cleanup only
            pass


class BridgeSource:
    """The WeightSource (rollout/partial.py) of a rollout rank: announced versions, received over the bridge."""

    def __init__(self, ranks: list[int], device: torch.device):
        self.ranks, self.device = [int(r) for r in ranks], device

    def arrived(self, version: int) -> bool:
        from tinyzero.single_controller.failure import control_store

        store = control_store()
        return store is not None and store.check([_ready_key(self.ranks, version)])

    def receive(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        return receive_params(bridge_group(self.ranks), self.ranks[0], self.device)
