"""SFT (single and multi-turn) and pairwise datasets: token layout and loss masks on the tiny tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tinyzero.data import DataConfig, PairwiseDataset, SFTDataset, StatefulDataLoader, write_parquet


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_single_turn_loss_mask_covers_response_only(tokenizer, tmp_path):
    path = str(tmp_path / "sft.parquet")
    write_parquet([{"prompt": "2+2=", "response": "4"}, {"prompt": "hi", "response": "hello there"}], path)
    ds = SFTDataset(path, tokenizer, DataConfig(max_length=64))
    item = ds[1]
    prompt_text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    expected = _ids(tokenizer, prompt_text) + _ids(tokenizer, "hello there") + [tokenizer.eos_token_id]
    n = len(expected)
    assert item["input_ids"][:n].tolist() == expected
    assert item["input_ids"][n:].eq(tokenizer.pad_token_id).all()
    assert item["attention_mask"].tolist() == [1] * n + [0] * (64 - n)
    assert item["position_ids"][:n].tolist() == list(range(n))
    p = len(_ids(tokenizer, prompt_text))
    assert item["loss_mask"].tolist() == [0] * p + [1] * (n - p) + [0] * (64 - n)
    raw = SFTDataset(path, tokenizer, DataConfig(max_length=64, apply_chat_template=False))
    assert tokenizer.decode(raw[0]["input_ids"][: raw[0]["attention_mask"].sum()]) == "2+2=4<|im_end|>"
    assert raw[0]["loss_mask"].sum() == 2  # "4" and eos
    batch = next(iter(StatefulDataLoader(ds, batch_size=2, shuffle=False)))
    assert batch.batch["loss_mask"].shape == (2, 64)


def test_multi_turn_masks_every_assistant_turn(tokenizer, tmp_path):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    path = str(tmp_path / "mt.parquet")
    write_parquet([{"messages": messages}], path)
    item = SFTDataset(path, tokenizer, DataConfig(max_length=128, messages_key="messages"))[0]
    n = int(item["attention_mask"].sum())
    ids = item["input_ids"][:n].tolist()
    mask = item["loss_mask"][:n].tolist()
    # Independent reference: ChatML written out by hand, assistant content + "<|im_end|>\n" trained.
    segments = [
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("2<|im_end|>\n", 1),
        ("<|im_start|>user\nand 2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("4<|im_end|>\n", 1),
    ]
    ref_ids, ref_mask = [], []
    for text, m in segments:
        seg = _ids(tokenizer, text)
        ref_ids += seg
        ref_mask += [m] * len(seg)
    assert ids == ref_ids and mask == ref_mask
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "2<|im_end|>\n4<|im_end|>\n"


def test_sft_truncation_and_errors(tokenizer, tmp_path):
    path = str(tmp_path / "long.parquet")
    write_parquet([{"prompt": "x" * 50, "response": "y" * 50}, {"prompt": "a", "response": "b"}], path)
    with pytest.raises(ValueError, match="row 0.*data.max_length=40"):
        SFTDataset(path, tokenizer, DataConfig(max_length=40))
    filt = SFTDataset(path, tokenizer, DataConfig(max_length=40, truncation="filter"))
    assert len(filt) == 1 and filt.num_filtered == 1
    right = SFTDataset(path, tokenizer, DataConfig(max_length=40, truncation="right", apply_chat_template=False))
    assert right[0]["attention_mask"].sum() == 40 and right[0]["loss_mask"].sum() == 0  # only prompt fits
    left = SFTDataset(path, tokenizer, DataConfig(max_length=40, truncation="left", apply_chat_template=False))
    assert left[0]["input_ids"].tolist() == _ids(tokenizer, "y" * 39) + [tokenizer.eos_token_id]
    assert left[0]["loss_mask"].sum() == 40
    bad = str(tmp_path / "bad.parquet")
    write_parquet([{"prompt": "a", "answer": "b"}], bad)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['response'\]"):
        SFTDataset(bad, tokenizer, DataConfig())


def test_pairwise_dataset(tokenizer, tmp_path):
    path = str(tmp_path / "pairs.parquet")
    write_parquet([{"prompt": "2+2=", "chosen": "4", "rejected": "five"}], path)
    item = PairwiseDataset(path, tokenizer, DataConfig(max_length=48))[0]
    prompt_ids = _ids(tokenizer, "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n")
    for side, text in (("chosen", "4"), ("rejected", "five")):
        expected = prompt_ids + _ids(tokenizer, text) + [tokenizer.eos_token_id]
        n = len(expected)
        assert item[f"{side}_input_ids"][:n].tolist() == expected
        assert int(item[f"{side}_attention_mask"].sum()) == n
        assert item[f"{side}_loss_mask"].tolist() == [0] * len(prompt_ids) + [1] * (n - len(prompt_ids)) + [0] * (48 - n)
