"""The offline tiny model: tokenizer round trips, special tokens, chat template, HF loading."""

from __future__ import annotations

import json
import os

import pytest
import torch

TEXTS = [
    "Using the numbers [3, 5, 8], create an equation that equals 24.\n<answer> (1 + 2) / 3 </answer>",
    "  leading spaces, trailing spaces  \n\n\ttab and blank lines\n",
    "unicode: h\u00e9llo w\u00f6rld \u4f60\u597d \u2014 done",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(tiny_model_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok(text, add_special_tokens=True)["input_ids"]
    assert tok.decode(ids) == text
    # Plain text (no special tokens) is one token per UTF-8 byte.
    if "<|" not in text:
        assert len(ids) == len(text.encode("utf-8"))


def test_tokenizer_json_matches_rebuilt_tokenizer(tiny_model_dir):
    """tokenizer.json loaded directly by `tokenizers` tokenizes exactly like the transformers class."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(os.path.join(tiny_model_dir, "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in TEXTS:
        assert raw.encode(text).ids == tok(text)["input_ids"]
        assert raw.decode(raw.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_and_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert tok.convert_tokens_to_ids("<|im_start|>") == 257
    assert tok("<|im_end|>")["input_ids"] == [tok.eos_token_id]
    assert tok.decode([ord("a"), tok.eos_token_id, ord("b")], skip_special_tokens=True) == "ab"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    gen = GenerationConfig.from_pretrained(tiny_model_dir)
    assert set(gen.eos_token_id) == {tok.eos_token_id, tok.pad_token_id}
    assert gen.pad_token_id == tok.pad_token_id


def test_model_loads_and_is_deterministic(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinyzero.models.tiny import build_tiny_model

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = json.load(open(os.path.join(tiny_model_dir, "config.json")))
    assert cfg["model_type"] == "qwen2" and cfg["max_position_embeddings"] >= 2048
    assert model.config.vocab_size == len(tok)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 500_000

    # Same seed -> identical weights; another seed -> different weights.
    same = build_tiny_model(str(tmp_path / "same"), seed=0)
    other = build_tiny_model(str(tmp_path / "other"), seed=1)
    ref = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    a = load_file(os.path.join(same, "model.safetensors"))
    b = load_file(os.path.join(other, "model.safetensors"))
    assert ref.keys() == a.keys() == b.keys()
    assert all(torch.equal(ref[k], a[k]) for k in ref)
    assert not all(torch.equal(ref[k], b[k]) for k in ref if not k.endswith("norm.weight"))

    # The HF forward runs and its logits equal the model's own lm_head on the final hidden state.
    ids = torch.tensor([tok("1 + 2 = 3")["input_ids"]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    ref_logits = out.hidden_states[-1].double() @ model.lm_head.weight.double().T
    torch.testing.assert_close(out.logits.double(), ref_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_cli(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cli_model"
    res = subprocess.run(
        [sys.executable, "-m", "tinyzero.models.tiny", "--out", str(out), "--num_layers", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    cfg = json.load(open(out / "config.json"))
    assert cfg["num_hidden_layers"] == 1
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
