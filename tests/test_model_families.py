"""The model-family registry: one entry gives a model_type the fused decoder, the tensor-parallel plan's
projection names and the FLOPs formula."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tinyzero.models.families import FAMILIES, ModelFamily, family_of, fused_model_types, register_family


def _config(model_type: str = "qwen2"):
    return SimpleNamespace(model_type=model_type, hidden_size=64, num_hidden_layers=2, intermediate_size=160,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=300)


def test_known_and_unknown_families():
    assert fused_model_types() == ("llama", "mistral", "qwen2", "qwen3")
    assert family_of(_config("mistral")).name == "llama"
    generic = family_of(_config("gpt2"))
    assert not generic.fused_decoder and generic.name == "generic"
    assert family_of(SimpleNamespace(config=_config("qwen3"))).name == "qwen3"  # a model: its .config


def test_flops_per_token_against_a_count_of_the_matmuls():
    """6 x (q, o: h x h; k, v: h x kv; gate, up, down: h x inter; head: vocab x h) + 6 L h s."""
    cfg = _config()
    h, kv, inter, vocab, layers = 64, 2 * 16, 160, 300, 2
    params = layers * (h * h + h * kv + h * kv + h * h + 3 * h * inter) + vocab * h
    assert family_of(cfg).flops_per_token(cfg, 0) == 6.0 * params
    assert family_of(cfg).flops_per_token(cfg, 10) - family_of(cfg).flops_per_token(cfg, 0) == 6.0 * layers * h * 10


def test_registering_a_family_reaches_the_decoder_and_the_plan(monkeypatch):
    """A new model_type with Llama-shaped blocks is one registration: the fused decoder accepts it and the run
    plan keeps the native engine's tensor-parallel decode for it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tinyzero.rollout.native.decoder import fused_supported

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert fused_supported(model) is None
    model.config.model_type = "newfamily"
    assert "is not one of" in fused_supported(model)
    monkeypatch.setitem(FAMILIES, "newfamily", ModelFamily("newfamily", ("newfamily",)))
    assert fused_supported(model) is None and "newfamily" in fused_model_types()
    with pytest.raises(ValueError, match="not nn.Linear"):  # other projection names: the plan checks them
        from tinyzero.models.tensor_parallel import _block_plan

        _block_plan(model.model.layers[0], "layers.0", ModelFamily("x", ("x",), attention=("wq", "wk", "wv", "wo")))


def test_register_family_replaces_by_model_type(monkeypatch):
    monkeypatch.setattr("tinyzero.models.families.FAMILIES", dict(FAMILIES))
    from tinyzero.models import families

    register_family(ModelFamily("qwen2-nofuse", ("qwen2",), fused_decoder=False))
    assert families.FAMILIES["qwen2"].name == "qwen2-nofuse"
