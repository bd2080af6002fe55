"""DataProto properties against plain-Python references: chunk/concat identity, repeat and reorder
by index loops, union conflicts, make_iterator coverage, save/load round trip, pad/unpad."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinyzero.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto


def _data(n: int = 6, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    return DataProto.from_dict(
        tensors={"input_ids": torch.randint(0, 100, (n, 5), generator=g),
                 "values": torch.randn(n, 5, generator=g),
                 "mask": torch.rand(n, 5, generator=g) > 0.5},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "gt": [{"answer": i * i} for i in range(n)]},
        meta_info={"temperature": 0.7},
    )


def _assert_same(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b)
    assert sorted(a.batch) == sorted(b.batch) and sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for k in a.batch:
        assert a.batch[k].dtype == b.batch[k].dtype and torch.equal(a.batch[k], b.batch[k]), k
    for k in a.non_tensor_batch:
        assert list(a.non_tensor_batch[k]) == list(b.non_tensor_batch[k]), k


def _row(d: DataProto, i: int) -> tuple:
    item = d[i]
    return (tuple(item.batch["input_ids"].tolist()), item.non_tensor_batch["uid"])


@pytest.mark.parametrize("n,k", [(6, 1), (6, 2), (6, 3), (6, 6), (12, 4)])
def test_chunk_then_concat_is_identity(n, k):
    d = _data(n)
    parts = d.chunk(k)
    assert [len(p) for p in parts] == [n // k] * k
    # chunk i holds rows i*n/k .. (i+1)*n/k - 1, by a row-by-row reference
    for i, p in enumerate(parts):
        assert [_row(p, j) for j in range(len(p))] == [_row(d, i * (n // k) + j) for j in range(n // k)]
    _assert_same(DataProto.concat(parts), d)
    assert DataProto.concat(parts).meta_info == d.meta_info


def test_chunk_uneven_raises_with_the_fix():
    with pytest.raises(ValueError, match="pad_dataproto_to_divisor"):
        _data(5).chunk(2)


@pytest.mark.parametrize("interleave", [True, False])
def test_repeat_matches_an_index_loop(interleave):
    d, times = _data(4), 3
    r = d.repeat(times, interleave=interleave)
    n = len(d)
    ref = [i for i in range(n) for _ in range(times)] if interleave else [i for _ in range(times) for i in range(n)]
    assert [_row(r, j) for j in range(len(r))] == [_row(d, i) for i in ref]


def test_reorder_and_select_idxs():
    d = _data(6)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    before = [_row(d, i) for i in range(6)]
    d.reorder(perm)
    assert [_row(d, j) for j in range(6)] == [before[i] for i in perm.tolist()]
    sel = _data(6).select_idxs(np.array([True, False, True, False, False, True]))
    assert sel.non_tensor_batch["uid"].tolist() == ["u0", "u2", "u5"]


def test_union_merges_and_refuses_conflicts():
    d = _data(4)
    extra = DataProto.from_dict({"old_log_probs": torch.zeros(4, 5)}, non_tensors={"score": [1, 2, 3, 4]})
    merged = d.union(extra)
    assert "old_log_probs" in merged.batch and merged.non_tensor_batch["score"].tolist() == [1, 2, 3, 4]
    same = DataProto.from_dict({"input_ids": d.batch["input_ids"].clone()})
    d.union(same)  # equal values on a shared key are fine
    clash = DataProto.from_dict({"input_ids": d.batch["input_ids"] + 1})
    with pytest.raises(ValueError, match="input_ids"):
        d.union(clash)
    with pytest.raises(ValueError, match="uid"):
        d.union(DataProto.from_dict(non_tensors={"uid": ["x"] * 4}))
    with pytest.raises(ValueError, match="temperature"):
        d.union(DataProto.from_dict(non_tensors={"uid": d.non_tensor_batch["uid"]}, meta_info={"temperature": 1.0}))


def test_make_iterator_covers_every_row_each_epoch():
    d = _data(8)
    batches = list(d.make_iterator(mini_batch_size=2, epochs=2, seed=1, dataloader_kwargs={"shuffle": True}))
    assert len(batches) == 8 and all(len(b) == 2 for b in batches)
    for epoch in range(2):
        uids = sorted(u for b in batches[epoch * 4:(epoch + 1) * 4] for u in b.non_tensor_batch["uid"])
        assert uids == sorted(d.non_tensor_batch["uid"].tolist())
    again = list(d.make_iterator(mini_batch_size=2, epochs=2, seed=1, dataloader_kwargs={"shuffle": True}))
    assert [b.non_tensor_batch["uid"].tolist() for b in again] == [b.non_tensor_batch["uid"].tolist() for b in batches]
    assert all(b.meta_info == d.meta_info for b in batches)


def test_save_and_load_round_trip(tmp_path):
    d = _data(5)
    path = tmp_path / "batch.pt"
    d.save_to_disk(path)
    back = DataProto.load_from_disk(path)
    _assert_same(back, d)
    assert back.meta_info == d.meta_info


@pytest.mark.parametrize("n,k", [(5, 2), (6, 4), (8, 4), (3, 5)])
def test_pad_then_unpad_is_identity(n, k):
    d = _data(n)
    padded, pad = pad_dataproto_to_divisor(d, k)
    assert len(padded) % k == 0 and pad == (-n) % k
    # padding rows repeat the leading rows, in order
    assert [_row(padded, n + j) for j in range(pad)] == [_row(d, j % n) for j in range(pad)]
    _assert_same(unpad_dataproto(padded, pad), d)
