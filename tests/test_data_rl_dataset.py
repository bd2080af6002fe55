"""RLHFDataset rendering / padding / truncation and the resumable dataloader, on the tiny tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tinyzero.data import DataConfig, RLHFDataset, StatefulDataLoader, write_parquet
from tinyzero.protocol import DataProto


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _rows(n: int, long_every: int = 0) -> list[dict]:
    rows = []
    for i in range(n):
        content = f"task {i}: add {i} and 3"
        if long_every and i % long_every == 0:
            content += " please" * 20
        rows.append({
            "data_source": "arithmetic",
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 3)},
            "extra_info": {"split": "train", "index": 100 + i},
            "difficulty": i % 4,
        })
    return rows


@pytest.fixture(scope="module")
def parquet_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rl") / "train.parquet")
    write_parquet(_rows(23, long_every=5), path)
    return path


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_template_and_raw_rendering(tokenizer, parquet_path):
    chat = RLHFDataset(parquet_path, tokenizer, DataConfig(max_prompt_length=256))
    raw = RLHFDataset(parquet_path, tokenizer, DataConfig(max_prompt_length=256, apply_chat_template=False))
    content = "task 1: add 1 and 3"
    expected_chat = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n" + content
                     + "<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(chat[1]["raw_prompt_ids"]) == expected_chat
    assert chat[1]["raw_prompt_ids"] == _ids(tokenizer, expected_chat)
    assert tokenizer.decode(raw[1]["raw_prompt_ids"]) == "be brief\n" + content


def test_left_padding_position_ids_and_passthrough(tokenizer, parquet_path):
    P = 200
    ds = RLHFDataset(parquet_path, tokenizer, DataConfig(max_prompt_length=P, apply_chat_template=False))
    item = ds[3]
    ids = item["raw_prompt_ids"]
    n, pad = len(ids), tokenizer.pad_token_id
    assert item["input_ids"].shape == (P,) and item["input_ids"].dtype == torch.long
    assert item["input_ids"].tolist() == [pad] * (P - n) + ids
    assert item["attention_mask"].tolist() == [0] * (P - n) + [1] * n
    assert item["position_ids"].tolist() == [0] * (P - n) + list(range(n))
    assert item["index"] == 103 and item["difficulty"] == 3 and item["data_source"] == "arithmetic"
    assert item["reward_model"]["ground_truth"] == "6" and "prompt" not in item
    batch = StatefulDataLoader(ds, batch_size=4, shuffle=False).__iter__().__next__()
    assert isinstance(batch, DataProto) and len(batch) == 4
    assert batch.batch["input_ids"].shape == (4, P)
    assert batch.non_tensor_batch["raw_prompt_ids"].dtype == object
    assert list(batch.non_tensor_batch["raw_prompt_ids"][0]) == ds[0]["raw_prompt_ids"]
    assert batch.non_tensor_batch["difficulty"].tolist() == [0, 1, 2, 3]
    assert batch.non_tensor_batch["extra_info"][2]["index"] == 102


def test_truncation_modes(tokenizer, parquet_path):
    limit = 40
    base = dict(max_prompt_length=limit, apply_chat_template=False)
    full = RLHFDataset(parquet_path, tokenizer, DataConfig(max_prompt_length=512, apply_chat_template=False))
    long_ids = full[5]["raw_prompt_ids"]
    assert len(long_ids) > limit and len(full[4]["raw_prompt_ids"]) <= limit

    # "error" stops at load, naming the first over-long row (row 0: every fifth prompt is long), how
    # many there are and the max_prompt_length that fits them all.
    longest = max(len(full[i]["raw_prompt_ids"]) for i in range(len(full)))
    with pytest.raises(ValueError) as e:
        RLHFDataset(parquet_path, tokenizer, DataConfig(truncation="error", **base))
    msg = str(e.value)
    assert parquet_path in msg and "row 0:" in msg and "5 of 23" in msg and "data.truncation" in msg
    assert f"data.max_prompt_length={longest}" in msg
    fits = RLHFDataset(parquet_path, tokenizer, DataConfig(truncation="error", max_prompt_length=longest,
                                                           apply_chat_template=False))
    assert fits[5]["raw_prompt_ids"] == long_ids

    left = RLHFDataset(parquet_path, tokenizer, DataConfig(truncation="left", **base))
    assert left[5]["raw_prompt_ids"] == long_ids[-limit:]
    assert left[5]["attention_mask"].sum() == limit
    right = RLHFDataset(parquet_path, tokenizer, DataConfig(truncation="right", **base))
    assert right[5]["raw_prompt_ids"] == long_ids[:limit]

    filt = RLHFDataset(parquet_path, tokenizer, DataConfig(truncation="filter", **base))
    n_long = sum(1 for i in range(len(full)) if len(full[i]["raw_prompt_ids"]) > limit)
    assert n_long == 5 and filt.num_filtered == n_long and len(filt) == 23 - n_long
    kept = [filt[i]["index"] for i in range(len(filt))]
    assert kept == [100 + i for i in range(23) if i % 5 != 0]


def test_missing_chat_template_is_a_clear_error(tokenizer, parquet_path):
    class NoTemplate:
        pad_token_id = tokenizer.pad_token_id
        eos_token_id = tokenizer.eos_token_id
        chat_template = None

    with pytest.raises(ValueError, match="apply_chat_template=False"):
        RLHFDataset(parquet_path, NoTemplate(), DataConfig())


def _collect(loader: StatefulDataLoader, num_batches: int) -> list[list[int]]:
    out = []
    while len(out) < num_batches:
        for batch in loader:
            out.append(list(batch.non_tensor_batch["index"]))
            if len(out) == num_batches:
                break
    return out


@pytest.mark.parametrize("stop_after,prefetch", [(1, True), (4, True), (5, True), (7, True), (5, False), (7, False)])
def test_loader_resume_equals_uninterrupted(tokenizer, parquet_path, stop_after, prefetch):
    ds = RLHFDataset(parquet_path, tokenizer, DataConfig(max_prompt_length=200, apply_chat_template=False))
    reference = _collect(StatefulDataLoader(ds, batch_size=4, shuffle=True, seed=7, prefetch=not prefetch), 13)
    first = StatefulDataLoader(ds, batch_size=4, shuffle=True, seed=7, prefetch=prefetch)
    head = _collect(first, stop_after)
    state = first.state_dict()
    assert state["epoch"] * 5 + state["batches_taken"] == stop_after  # 5 batches per epoch
    resumed = StatefulDataLoader(ds, batch_size=4, shuffle=True, seed=999, prefetch=prefetch)  # seed from state
    resumed.load_state_dict(state)
    tail = _collect(resumed, 13 - stop_after)
    assert head + tail == reference


def test_loader_epochs_are_seeded_permutations(tokenizer, parquet_path):
    ds = RLHFDataset(parquet_path, tokenizer, DataConfig(max_prompt_length=200, apply_chat_template=False))
    loader = StatefulDataLoader(ds, batch_size=5, shuffle=True, seed=3)
    assert len(loader) == 4  # 23 // 5, last partial batch dropped
    epochs = []
    for _ in range(3):
        assert loader.epoch == len(epochs)
        epochs.append([i for b in loader for i in b.non_tensor_batch["index"]])
    for e in epochs:
        assert len(e) == 20 and len(set(e)) == 20
    assert epochs[0] != epochs[1]
    # Identical on every "rank": an independent loader with the same seed gives the same order.
    other = StatefulDataLoader(ds, batch_size=5, shuffle=True, seed=3)
    assert [i for b in other for i in b.non_tensor_batch["index"]] == epochs[0]
    g = torch.Generator().manual_seed(3)
    assert epochs[0] == [100 + i for i in torch.randperm(23, generator=g)[:20].tolist()]


def test_loader_state_mismatch_and_small_dataset(tokenizer, parquet_path):
    ds = RLHFDataset(parquet_path, tokenizer, DataConfig(max_prompt_length=200, apply_chat_template=False))
    loader = StatefulDataLoader(ds, batch_size=4)
    with pytest.raises(ValueError, match="same data files"):
        loader.load_state_dict({"epoch": 0, "batches_taken": 0, "seed": 0, "num_samples": 99})
    with pytest.raises(ValueError, match="fewer than one batch"):
        StatefulDataLoader(ds, batch_size=64)
