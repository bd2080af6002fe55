"""DataProto: the batch that flows between roles (veRL's data protocol, without tensordict).

A `DataProto` holds three things about one batch of samples:

- `batch`: a `TensorBatch`, a dict of tensors that all share dimension 0 (the sample axis);
- `non_tensor_batch`: a dict of 1-D numpy object arrays of the same length (strings, dicts,
  token lists: anything that is not a fixed-shape tensor);
- `meta_info`: a plain dict of settings that apply to the whole batch (temperature, eos id,
  metrics coming back from a worker).

Every method keeps veRL's semantics so driver code reads the same: `union` merges two views
of the same samples and refuses conflicting values, `repeat(n, interleave=True)` puts the n
copies of sample i at rows i*n .. i*n+n-1, `chunk(k)` splits into k equal parts for
data-parallel dispatch, and `concat` undoes it.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "DataProto",
    "DataProtoItem",
    "TensorBatch",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "union_numpy_dict",
]


class TensorBatch(dict):
    """A dict of tensors sharing dimension 0; `batch_size` is that shared length.

    The subset of tensordict's TensorDict that the trainer needs: dict access, indexing along
    the sample axis, device moves. Keys are strings; values are torch tensors.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None, batch_size: int | None = None):
        super().__init__(tensors or {})
        sizes = {k: v.shape[0] for k, v in self.items()}
        if batch_size is None and sizes:
            batch_size = next(iter(sizes.values()))
        bad = {k: s for k, s in sizes.items() if s != batch_size}
        if bad:
            raise ValueError(
                f"tensors in one batch must share dimension 0 (expected {batch_size}); "
                f"offending keys and sizes: {bad}"
            )
        for k, v in self.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"batch key {k!r} holds {type(v).__name__}, expected a torch.Tensor")
        self.batch_size = batch_size if batch_size is not None else 0

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"batch key {key!r}: expected a torch.Tensor, got {type(value).__name__}")
        if len(self) and value.shape[0] != self.batch_size:
            raise ValueError(
                f"batch key {key!r} has {value.shape[0]} rows but the batch has {self.batch_size}"
            )
        if not len(self):
            self.batch_size = value.shape[0]
        super().__setitem__(key, value)

    def index(self, idx) -> TensorBatch:
        out = TensorBatch({k: v[idx] for k, v in self.items()})
        if not len(out):
            out.batch_size = len(range(self.batch_size)[idx]) if isinstance(idx, slice) else len(idx)
        return out

    def to(self, device) -> TensorBatch:
        return TensorBatch({k: v.to(device) for k, v in self.items()}, batch_size=self.batch_size)

    def select(self, *keys: str) -> TensorBatch:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"batch has no keys {missing}; available: {sorted(self)}")
        return TensorBatch({k: self[k] for k in keys}, batch_size=self.batch_size)

    def clone(self) -> TensorBatch:
        return TensorBatch({k: v.clone() for k, v in self.items()}, batch_size=self.batch_size)


def _as_object_array(values) -> np.ndarray:
    """A 1-D numpy object array whose elements are exactly `values` (no nested broadcasting)."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    values = list(values)
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def _values_equal(a, b) -> bool:
    if a is b:
        return True
    try:
        eq = a == b
        if isinstance(eq, np.ndarray):
            return bool(eq.all())
        return bool(eq)
    except Exception:  # noqa: BLE001 - incomparable objects are different
        return False


def union_numpy_dict(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Merge b into a; a key present in both must hold equal values."""
    out = dict(a)
    for k, v in b.items():
        if k in out:
            if len(out[k]) != len(v) or not all(_values_equal(x, y) for x, y in zip(out[k], v)):
                raise ValueError(f"union: non-tensor key {k!r} exists on both sides with different values")
        else:
            out[k] = v
    return out


@dataclass
class DataProtoItem:
    """One sample of a DataProto: tensors without the batch axis, plain non-tensor values."""

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass
class DataProto:
    batch: TensorBatch = field(default_factory=TensorBatch)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.batch, TensorBatch):
            self.batch = TensorBatch(self.batch or {})
        self.non_tensor_batch = {k: _as_object_array(v) for k, v in (self.non_tensor_batch or {}).items()}
        self.meta_info = dict(self.meta_info or {})
        self.check_consistency()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, tensors: Mapping[str, torch.Tensor] | None = None,
                  non_tensors: Mapping[str, Any] | None = None, meta_info: dict | None = None) -> DataProto:
        return cls(batch=TensorBatch(dict(tensors or {})),
                   non_tensor_batch={k: _as_object_array(v) for k, v in (non_tensors or {}).items()},
                   meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: Mapping[str, Any], meta_info: dict | None = None) -> DataProto:
        """Split one dict into tensors (torch.Tensor values) and non-tensors (everything else)."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info)

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        if len(self.batch):
            return self.batch.batch_size
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return self.batch.batch_size

    def check_consistency(self) -> None:
        """Every tensor and non-tensor has the same number of rows; non-tensors are 1-D object arrays."""
        sizes = {f"batch[{k!r}]": v.shape[0] for k, v in self.batch.items()}
        for k, v in self.non_tensor_batch.items():
            if not isinstance(v, np.ndarray) or v.ndim != 1:
                raise ValueError(f"non_tensor_batch[{k!r}] must be a 1-D numpy array, got "
                                 f"{type(v).__name__} with shape {getattr(v, 'shape', None)}")
            sizes[f"non_tensor_batch[{k!r}]"] = len(v)
        if len(set(sizes.values())) > 1:
            raise ValueError(f"DataProto fields disagree on the number of rows: {sizes}")

    def __getitem__(self, item):
        if isinstance(item, (int, np.integer)):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"index {item} out of range for a DataProto of {n} rows")
            return DataProtoItem(
                batch={k: v[item] for k, v in self.batch.items()},
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, slice):
            return self._index(item)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"cannot index a DataProto with {type(item).__name__}")

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    def _index(self, idx) -> DataProto:
        """Rows by a slice or an int64 index array; meta_info is shared (shallow)."""
        if isinstance(idx, slice):
            np_idx = idx
        else:
            np_idx = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
        t_idx = idx if isinstance(idx, slice) else torch.as_tensor(np_idx, dtype=torch.long)
        batch = TensorBatch({k: v[t_idx.to(v.device) if isinstance(t_idx, torch.Tensor) else t_idx]
                             for k, v in self.batch.items()})
        if not len(batch):
            batch.batch_size = len(range(len(self))[idx]) if isinstance(idx, slice) else len(np_idx)
        non_tensor = {k: v[np_idx] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)

    def select_idxs(self, idxs) -> DataProto:
        """Rows by index list/array/tensor, or by a boolean mask of length len(self)."""
        if isinstance(idxs, torch.Tensor):
            idxs = idxs.cpu().numpy()
        idxs = np.asarray(idxs)
        if idxs.dtype == bool:
            if idxs.shape != (len(self),):
                raise ValueError(f"boolean mask of shape {idxs.shape} does not match {len(self)} rows")
            idxs = np.nonzero(idxs)[0]
        return self._index(idxs.astype(np.int64))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        return self._index(slice(start, end, step))

    # ------------------------------------------------------------------ key operations
    def select(self, batch_keys: Sequence[str] | None = None, non_tensor_batch_keys: Sequence[str] | None = None,
               meta_info_keys: Sequence[str] | None = None, deepcopy: bool = False) -> DataProto:
        """A view holding only the named keys (None keeps all of that kind)."""
        batch = self.batch.select(*batch_keys) if batch_keys is not None else TensorBatch(
            dict(self.batch), batch_size=self.batch.batch_size)
        if batch_keys is not None:
            batch.batch_size = len(self)
        nt_keys = list(self.non_tensor_batch) if non_tensor_batch_keys is None else list(non_tensor_batch_keys)
        missing = [k for k in nt_keys if k not in self.non_tensor_batch]
        if missing:
            raise KeyError(f"non_tensor_batch has no keys {missing}; available: {sorted(self.non_tensor_batch)}")
        non_tensor = {k: self.non_tensor_batch[k] for k in nt_keys}
        meta = self.meta_info if meta_info_keys is None else {k: self.meta_info[k] for k in meta_info_keys}
        if deepcopy:
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(meta))

    def pop(self, batch_keys: Sequence[str] | None = None, non_tensor_batch_keys: Sequence[str] | None = None,
            meta_info_keys: Sequence[str] | None = None) -> DataProto:
        """Remove the named keys from self and return them as a new DataProto."""
        batch_keys = list(batch_keys or [])
        nt_keys = list(non_tensor_batch_keys or [])
        mi_keys = list(meta_info_keys or [])
        missing = ([k for k in batch_keys if k not in self.batch]
                   + [k for k in nt_keys if k not in self.non_tensor_batch]
                   + [k for k in mi_keys if k not in self.meta_info])
        if missing:
            raise KeyError(f"pop: keys not present: {missing}")
        n = len(self)
        batch = TensorBatch({k: dict.pop(self.batch, k) for k in batch_keys}, batch_size=n)
        non_tensor = {k: self.non_tensor_batch.pop(k) for k in nt_keys}
        meta = {k: self.meta_info.pop(k) for k in mi_keys}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename tensor keys in place; returns self."""
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename: {len(old_keys)} old keys but {len(new_keys)} new keys")
        for o, n in zip(old_keys, new_keys):
            if o not in self.batch:
                raise KeyError(f"rename: batch has no key {o!r}")
            dict.__setitem__(self.batch, n, dict.pop(self.batch, o))
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge other's keys into self (in place, returns self); equal keys must hold equal values."""
        if len(self.batch) and len(other.batch) and len(self) != len(other):
            raise ValueError(f"union: {len(self)} rows vs {len(other)} rows")
        for k, v in other.batch.items():
            if k in self.batch:
                mine = self.batch[k]
                if mine.shape != v.shape or not torch.equal(mine, v.to(mine.device)):
                    raise ValueError(f"union: tensor key {k!r} exists on both sides with different values")
            else:
                self.batch[k] = v
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        for k, v in other.meta_info.items():
            if k in self.meta_info and not _values_equal(self.meta_info[k], v):
                raise ValueError(f"union: meta_info key {k!r} exists on both sides with different values")
            self.meta_info[k] = v
        self.check_consistency()
        return self

    # ------------------------------------------------------------------ splitting and joining
    def chunk(self, chunks: int) -> list[DataProto]:
        """k equal parts, in order (len must divide; use pad_dataproto_to_divisor first)."""
        n = len(self)
        if chunks <= 0 or n % chunks:
            raise ValueError(f"chunk: {n} rows do not split into {chunks} equal chunks; "
                             "pad with pad_dataproto_to_divisor first")
        size = n // chunks
        return [self._index(slice(i * size, (i + 1) * size)) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of split_size rows (the last may be shorter)."""
        if split_size <= 0:
            raise ValueError(f"split: split_size must be positive, got {split_size}")
        return [self._index(slice(i, i + split_size)) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Rows of all parts in order; meta_info of the first part."""
        data = list(data)
        if not data:
            raise ValueError("concat: nothing to concatenate")
        keys = set(data[0].batch)
        nt_keys = set(data[0].non_tensor_batch)
        for i, d in enumerate(data[1:], 1):
            if set(d.batch) != keys or set(d.non_tensor_batch) != nt_keys:
                raise ValueError(f"concat: part {i} has keys {sorted(d.batch)} / {sorted(d.non_tensor_batch)}, "
                                 f"part 0 has {sorted(keys)} / {sorted(nt_keys)}")
        batch = TensorBatch({k: torch.cat([d.batch[k] for d in data]) for k in data[0].batch},
                            batch_size=sum(len(d) for d in data))
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in data[0].non_tensor_batch}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data[0].meta_info))

    def reorder(self, indices: torch.Tensor) -> None:
        """Permute rows in place by `indices` (row i becomes old row indices[i])."""
        reordered = self.select_idxs(indices)
        self.batch = reordered.batch
        self.non_tensor_batch = reordered.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row repeat_times times: interleaved (a a b b) or tiled (a b a b)."""
        if repeat_times < 1:
            raise ValueError(f"repeat: repeat_times must be >= 1, got {repeat_times}")
        n = len(self)
        base = np.arange(n)
        idx = np.repeat(base, repeat_times) if interleave else np.tile(base, repeat_times)
        return self._index(idx)

    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      dataloader_kwargs: dict | None = None) -> Iterator[DataProto]:
        """Mini-batches of mini_batch_size rows over `epochs` passes; shuffled when
        dataloader_kwargs has shuffle=True (seeded by `seed`). len must divide evenly."""
        n = len(self)
        if mini_batch_size <= 0 or n % mini_batch_size:
            raise ValueError(f"make_iterator: {n} rows do not split into mini-batches of {mini_batch_size}")
        shuffle = bool((dataloader_kwargs or {}).get("shuffle", False))
        generator = torch.Generator().manual_seed(seed) if seed is not None else None

        def gen():
            for _ in range(epochs):
                order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
                for start in range(0, n, mini_batch_size):
                    part = self.select_idxs(order[start:start + mini_batch_size])
                    part.meta_info = dict(self.meta_info)
                    yield part

        return gen()

    def to(self, device) -> DataProto:
        self.batch = self.batch.to(device)
        return self

    # ------------------------------------------------------------------ persistence
    def save_to_disk(self, path: str | os.PathLike) -> None:
        """Write tensors with torch.save (plain tensors only) and non-tensors as JSON.

        Loading never unpickles arbitrary objects: tensors load with weights_only=True and
        non-tensors must be JSON-serialisable (str, numbers, lists, dicts, None).
        """
        payload = {"batch": dict(self.batch), "batch_size": torch.tensor(len(self))}
        try:
            nt = json.dumps({k: v.tolist() for k, v in self.non_tensor_batch.items()})
            meta = json.dumps(self.meta_info)
        except TypeError as e:
            raise TypeError(f"save_to_disk: non_tensor_batch and meta_info must be JSON-serialisable ({e})") from e
        payload["non_tensor_json"] = torch.frombuffer(bytearray(nt.encode()), dtype=torch.uint8)
        payload["meta_json"] = torch.frombuffer(bytearray(meta.encode()), dtype=torch.uint8)
        tmp = f"{os.fspath(path)}.tmp"
        torch.save(payload, tmp)
        os.replace(tmp, path)

    @staticmethod
    def load_from_disk(path: str | os.PathLike) -> DataProto:
        payload = torch.load(path, weights_only=True, map_location="cpu")
        nt = json.loads(bytes(payload["non_tensor_json"].numpy()).decode()) if payload["non_tensor_json"].numel() else {}
        meta = json.loads(bytes(payload["meta_json"].numpy()).decode()) if payload["meta_json"].numel() else {}
        batch = TensorBatch(payload["batch"], batch_size=int(payload["batch_size"]))
        return DataProto(batch=batch, non_tensor_batch={k: _as_object_array(v) for k, v in nt.items()},
                         meta_info=meta)

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.batch.items()}
        return (f"DataProto(len={len(self)}, batch={shapes}, non_tensor={sorted(self.non_tensor_batch)}, "
                f"meta_info={sorted(self.meta_info)})")


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad by repeating leading rows until len is a multiple of size_divisor; returns (data, pad_size)."""
    if size_divisor <= 0:
        raise ValueError(f"size_divisor must be positive, got {size_divisor}")
    n = len(data)
    pad = (-n) % size_divisor
    if pad == 0:
        return data, 0
    if n == 0:
        raise ValueError("cannot pad an empty DataProto")
    idx = np.concatenate([np.arange(n), np.arange(pad) % n])
    return data.select_idxs(idx), pad


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the pad_size rows that pad_dataproto_to_divisor appended."""
    if pad_size:
        return data._index(slice(0, len(data) - pad_size))
    return data


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
