"""Model loading from local folders: errors before any distributed work, dtype/attn choice, value heads."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tinyzero.models.config import FSDPConfig, ModelConfig
from tinyzero.models.loading import (
    check_model_path,
    load_causal_lm,
    load_hf_config,
    load_tokenizer,
    pick_attn_implementation,
    pick_dtype,
)


def test_missing_path_and_no_weights(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="does not exist"):
        check_model_path(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="empty"):
        check_model_path("")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(tiny_model_dir, "config.json"), no_weights)
    with pytest.raises(ValueError, match="holds no weights"):
        load_causal_lm(str(no_weights))
    # The config alone is enough for meta construction.
    meta = load_causal_lm(str(no_weights), device="meta")
    assert all(p.device.type == "meta" for p in meta.parameters())
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_causal_lm(str(no_config))
    with pytest.raises(ValueError, match="is not an existing folder"):
        load_tokenizer(str(tmp_path / "nope"))


def test_pick_dtype_and_attn():
    assert pick_dtype("cpu", "auto") == torch.float32
    assert pick_dtype("cpu", "bf16") == torch.bfloat16
    assert pick_attn_implementation("cpu", "auto") == "sdpa"
    assert pick_attn_implementation("cpu", "eager") == "eager"
    with pytest.raises(ValueError, match="flash_attention_2"):
        pick_attn_implementation("cpu", "flash_attention_2")
    with pytest.raises(ValueError, match="unknown dtype"):
        pick_dtype("cpu", "fp8")


def test_configs_validate():
    with pytest.raises(ValueError, match="model.dtype"):
        ModelConfig(path="x", dtype="float8")
    with pytest.raises(ValueError, match="gradient_checkpointing_every_n_layers=0: use 1"):
        ModelConfig(path="x", gradient_checkpointing_every_n_layers=0)
    with pytest.raises(ValueError, match="fsdp_size"):
        FSDPConfig(fsdp_size=0)


def test_load_causal_lm_matches_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = load_causal_lm(tiny_model_dir, dtype="fp32")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    bf16 = load_causal_lm(tiny_model_dir, dtype="bf16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    cfg = load_hf_config(tiny_model_dir, override_config={"attention_dropout": 0.25})
    assert cfg.attention_dropout == 0.25
    tok = load_tokenizer(tiny_model_dir)
    assert tok.padding_side == "left" and tok.pad_token_id == 256


def test_value_and_reward_models(tiny_model_dir, tmp_path):
    from tinyzero.models.value import checkpoint_has_head, load_reward_model, load_value_model

    lm = load_causal_lm(tiny_model_dir)
    v1 = load_value_model(tiny_model_dir)
    v2 = load_value_model(tiny_model_dir)
    assert not checkpoint_has_head(tiny_model_dir)
    # Deterministic new head; backbone equals the causal LM's.
    assert torch.equal(v1.score.weight, v2.score.weight) and v1.score.weight.abs().sum() > 0
    for (n, p), (n2, p2) in zip(v1.model.named_parameters(), lm.model.named_parameters()):
        assert n == n2 and torch.equal(p, p2)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        values = v1(ids).logits
        hidden = lm.model(ids).last_hidden_state
    assert values.shape == (2, 7, 1)
    ref = hidden.double() @ v1.score.weight.double().T + v1.score.bias.double()
    torch.testing.assert_close(values.double(), ref, atol=1e-5, rtol=1e-5)

    # A saved critic keeps its trained head.
    with torch.no_grad():
        v1.score.weight.add_(1.0)
    v1.save_pretrained(tmp_path / "critic")
    assert checkpoint_has_head(str(tmp_path / "critic"))
    v3 = load_value_model(str(tmp_path / "critic"))
    assert torch.equal(v3.score.weight, v1.score.weight)

    with pytest.warns(UserWarning, match="no trained `score` head"):
        rm = load_reward_model(tiny_model_dir)
    with torch.no_grad():
        out = rm(ids).logits
    assert out.shape == (2, 1)


def _write_arch(folder, arch: str, tiny_model_dir: str) -> str:
    """A small random Llama / Mistral folder sharing the tiny tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    common = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=256, eos_token_id=258, bos_token_id=256, tie_word_embeddings=False)
    cfg = LlamaConfig(**common) if arch == "llama" else MistralConfig(sliding_window=None, **common)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model_dir, name), folder)
    return str(folder)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_other_architectures(tiny_model_dir, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from tinyzero.models.fsdp import decoder_layers
    from tinyzero.models.value import load_value_model

    path = _write_arch(tmp_path / arch, arch, tiny_model_dir)
    model = load_causal_lm(path)
    assert model.config.model_type == arch and len(decoder_layers(model)) == 3
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    value = load_value_model(path)
    assert len(decoder_layers(value)) == 3
    with torch.no_grad():
        assert value(ids).logits.shape == (2, 9, 1)
    meta = load_causal_lm(path, device="meta")
    assert sum(p.numel() for p in meta.parameters()) == sum(p.numel() for p in model.parameters())
