"""Moving worker outputs between ranks: status + gather inside a pool, broadcast out of it.

One small object collective per call carries every rank's status (ok or traceback) and the
description of its output: plain Python values travel inside it, a DataProto travels as its
non-tensor part plus (key, shape, dtype) of each tensor. Tensors then move with one
`all_gather` per key straight into the concatenated result (rows padded to the longest
chunk only when chunks differ in length), so a DP_COMPUTE_PROTO round trip costs the bare
collective plus one tiny exchange, and tensors are never pickled.
"""

from __future__ import annotations

import math
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tinyzero.single_controller.failure import RemoteWorkerError, describe_failure, guard, record_abort

__all__ = ["Envelope", "exchange", "raise_if_failed", "gather_protos", "broadcast_value", "format_failure"]


@dataclass
class TensorSpec:
    key: str
    shape: tuple
    dtype: torch.dtype
    device_type: str


@dataclass
class Envelope:
    """What one rank contributes to the per-call status exchange."""

    error: str | None = None
    kind: str = "none"            # "none" (no output), "obj" (value inside), "proto" (DataProto)
    value: Any = None             # the value ("obj") or (non_tensor_batch, meta_info, rows) ("proto")
    specs: list[TensorSpec] = field(default_factory=list)


def format_failure(label: str, global_rank: int, pool_rank: int) -> str:
    """The exception being handled, as it travels to the other ranks (failure.describe_failure)."""
    return describe_failure(sys.exc_info()[1], f"{label} raised on rank {global_rank} (pool rank {pool_rank})",
                            global_rank)


def make_envelope(output, error: str | None, contribute: bool) -> Envelope:
    from tinyzero.protocol import DataProto

    if error is not None:
        return Envelope(error=error)
    if not contribute:
        return Envelope()
    if isinstance(output, DataProto):
        specs = [TensorSpec(k, tuple(v.shape), v.dtype, v.device.type) for k, v in output.batch.items()]
        return Envelope(kind="proto", value=(output.non_tensor_batch, output.meta_info, len(output)), specs=specs)
    return Envelope(kind="obj", value=output)


_SLOT_BYTES = 8192  # envelopes up to this size travel in a single fixed-size all_gather


def exchange(env: Envelope, group, label: str) -> list[Envelope]:
    """Every rank's envelope, in group-rank order.

    One all_gather of fixed-size slots covers the usual small envelope (torch's
    all_gather_object needs two collectives); a rank whose envelope is larger says so in its
    slot's length field and the long ones follow in a second all_gather.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return [env]
    try:
        payload = pickle.dumps(env, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - an unpicklable output must fail every rank, not hang them
        rank = dist.get_rank()
        error = (f"{label}: the output on rank {rank} cannot be sent to the other ranks ({type(e).__name__}: {e}); "
                 "return tensors, DataProto or plain Python values")
        record_abort(error)
        payload = pickle.dumps(Envelope(error=error), protocol=pickle.HIGHEST_PROTOCOL)
    slot = torch.zeros(_SLOT_BYTES + 8, dtype=torch.uint8)
    slot[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    if len(payload) <= _SLOT_BYTES:
        slot[8:8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    slots = torch.empty((n, _SLOT_BYTES + 8), dtype=torch.uint8)
    with guard(label):
        dist.all_gather(list(slots.unbind(0)), slot, group=group)
    sizes = slots[:, :8].contiguous().view(torch.int64).reshape(-1).tolist()
    longest = max(sizes)
    if longest > _SLOT_BYTES:
        big = torch.zeros(longest, dtype=torch.uint8)
        big[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        bigs = torch.empty((n, longest), dtype=torch.uint8)
        with guard(label):
            dist.all_gather(list(bigs.unbind(0)), big, group=group)
    out = []
    for i, size in enumerate(sizes):
        raw = bigs[i, :size] if size > _SLOT_BYTES else slots[i, 8:8 + size]
        out.append(pickle.loads(raw.numpy().tobytes()))
    return out


def raise_if_failed(envs: list[Envelope], ranks: list[int], label: str) -> None:
    for i, env in enumerate(envs):
        if env.error is not None:
            record_abort(env.error)
            raise RemoteWorkerError(f"{label} failed on rank {ranks[i]}; its traceback:\n{env.error}",
                                    rank=ranks[i], remote_traceback=env.error)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view: any dtype (bool, bfloat16, complex) moves as raw bytes."""
    return t.detach().reshape(-1).view(torch.uint8)


def _start_gather(local: torch.Tensor | None, rows: list[int], trail: tuple, dtype: torch.dtype,
                  device: torch.device, order: list[int], group):
    """Start gathering every rank's rows of one tensor (non-contributors send padding).

    Returns (work or None, finish) where finish() gives the rows concatenated in `order`; the
    usual case (equal chunks, rank order) lands straight in the result, no copy.
    """
    n = len(rows)
    width = max(rows)
    total = sum(rows[i] for i in order)
    if width == 0 or math.prod(trail) == 0:
        empty = torch.empty((total, *trail), dtype=dtype, device=device)
        return None, lambda: empty
    out = torch.empty((n * width, *trail), dtype=dtype, device=device)
    if local is not None and local.shape[0] == width:
        send = local.detach().contiguous()
    else:
        send = torch.zeros((width, *trail), dtype=dtype, device=device)
        if local is not None and local.shape[0]:
            send[: local.shape[0]] = local
    views = list(_as_bytes(out).view(n, -1).unbind(0))
    work = dist.all_gather(views, _as_bytes(send), group=group, async_op=True)
    if all(r == width for r in rows) and order == list(range(n)):
        return work, lambda: out
    blocks = out.view(n, width, *trail)
    return work, lambda: torch.cat([blocks[i, : rows[i]] for i in order])


def protos_compatible(envs: list[Envelope], ranks: list[int]) -> bool:
    """Whether the DataProtos of these ranks can be gathered tensor by tensor (same keys, same
    dtype / device / trailing shape per key; row counts may differ)."""
    ref = [(s.key, s.shape[1:], s.dtype, s.device_type) for s in envs[ranks[0]].specs]
    return all([(s.key, s.shape[1:], s.dtype, s.device_type) for s in envs[i].specs] == ref for i in ranks)


def gather_protos(envs: list[Envelope], local, order: list[int], group, label: str):
    """Concatenate the DataProto outputs of the pool ranks in `order` into one DataProto on every rank."""
    from tinyzero.distributed import get_device
    from tinyzero.protocol import DataProto, TensorBatch

    for i in order:
        if envs[i].kind != "proto":
            got = "nothing" if envs[i].kind == "none" else type(envs[i].value).__name__
            raise TypeError(f"{label}: a DataProto-collecting method must return a DataProto on every "
                            f"collecting rank; pool rank {i} returned {got}")
    first = envs[order[0]]
    keys = [s.key for s in first.specs]
    for i in order:
        if [s.key for s in envs[i].specs] != keys:
            raise ValueError(f"{label}: pool ranks {order[0]} and {i} returned DataProtos with different tensor keys "
                             f"{keys} vs {[s.key for s in envs[i].specs]}")
    contributing = set(order)
    pending = {}
    for j, key in enumerate(keys):
        specs = {i: envs[i].specs[j] for i in order}
        ref = specs[order[0]]
        for i, s in specs.items():
            if s.shape[1:] != ref.shape[1:] or s.dtype != ref.dtype or s.device_type != ref.device_type:
                raise ValueError(f"{label}: tensor {key!r} is {ref.dtype} {ref.shape} on {ref.device_type} at pool rank "
                                 f"{order[0]} but {s.dtype} {s.shape} on {s.device_type} at pool rank {i}; "
                                 "collected chunks must agree on everything but the row count")
        rows = [specs[i].shape[0] if i in contributing else 0 for i in range(len(envs))]
        device = get_device() if ref.device_type != "cpu" else torch.device("cpu")
        mine = local.batch[key] if local is not None and dist.get_rank(group) in contributing else None
        with guard(label):  # all keys in flight at once: one wait instead of one per key
            pending[key] = _start_gather(mine, rows, tuple(ref.shape[1:]), ref.dtype, device, order, group)
    tensors = {}
    for key, (work, finish) in pending.items():
        if work is not None:
            with guard(label):
                work.wait()
        tensors[key] = finish()
    total = sum(envs[i].value[2] for i in order)
    non_tensor = {}
    for k in first.value[0]:
        non_tensor[k] = np.concatenate([envs[i].value[0][k] for i in order])
    batch = TensorBatch(tensors, batch_size=total)
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(first.value[1]))


def broadcast_value(value, src_index: int, group, label: str, header: Envelope | None = None):
    """Broadcast a result from group rank src_index: DataProto tensors by tensor broadcast, anything
    else pickled. `header` (the source's envelope, known on every rank) skips the object broadcast."""
    from tinyzero.distributed import get_device
    from tinyzero.protocol import DataProto, TensorBatch

    me = dist.get_rank(group)
    src = dist.get_global_rank(group, src_index)
    if header is None:
        box = [make_envelope(value, None, True) if me == src_index else None]
        with guard(label):
            dist.broadcast_object_list(box, src=src, group=group)
        header = box[0]
    if header.kind != "proto":
        return value if me == src_index else header.value
    tensors, works = {}, []
    for s in header.specs:
        if me == src_index:
            t = value.batch[s.key].detach().contiguous()
        else:
            device = get_device() if s.device_type != "cpu" else torch.device("cpu")
            t = torch.empty(s.shape, dtype=s.dtype, device=device)
        if t.numel():
            with guard(label):
                works.append(dist.broadcast(_as_bytes(t), src=src, group=group, async_op=True))
        tensors[s.key] = t
    for work in works:
        with guard(label):
            work.wait()
    if me == src_index:
        return value
    non_tensor, meta, n = header.value
    return DataProto(batch=TensorBatch(tensors, batch_size=n), non_tensor_batch=non_tensor, meta_info=dict(meta))
