"""What tinyzero knows about a model family, registered in one place.

Any Hugging Face causal LM trains without an entry here (FSDP2 finds its decoder layers, log-probs
come from its hidden states and head, the native engine decodes it through HF's forward). An entry
adds speed and measurements for the models of its `model_type`s:

    fused_decoder        the native engine's fused decoder (static KV cache, fused q/k/v and gate/up)
                         and its tensor-parallel decode run it
    attention / mlp      the projection names the tensor-parallel plan splits: q, k, v by columns and
                         o by rows; gate and up by columns and down by rows
    flops_per_token      training FLOPs per token at a sequence length (perf/mfu/actor, bench MFU)

A new family with Llama-shaped blocks (RMSNorm, RoPE, `self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj`) is one `register_family` call here, with a test that the fused decoder's
greedy ids equal HF generate's (tests/test_rollout_native.py shows how).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["FAMILIES", "ModelFamily", "family_of", "fused_model_types", "llama_flops_per_token",
           "register_family"]


def llama_flops_per_token(hf_config, seq_len: float) -> float:
    """Training FLOPs per token of a Llama-shaped decoder: 6 x matmul parameters (q, k, v, o, gate, up,
    down, the head) + causal attention (12 L h s, halved by the mask)."""
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    inter = getattr(hf_config, "intermediate_size", None) or 4 * h
    heads = hf_config.num_attention_heads
    kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * (h // heads)
    matmul_params = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + hf_config.vocab_size * h
    return 6.0 * matmul_params + 6.0 * layers * h * seq_len


@dataclass(frozen=True)
class ModelFamily:
    """One family's knowledge (see the module docstring)."""

    name: str
    model_types: tuple[str, ...]
    fused_decoder: bool = True
    attention: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    flops_per_token: Callable[[object, float], float] = field(default=llama_flops_per_token)


FAMILIES: dict[str, ModelFamily] = {}
"""model_type -> its family."""

_GENERIC = ModelFamily("generic", (), fused_decoder=False)
"""Models no entry names: HF's forward for decoding, the Llama-shaped plan and formula where they fit."""


def register_family(family: ModelFamily) -> ModelFamily:
    """Register `family` for each of its model_types (a later registration of a type replaces it)."""
    for model_type in family.model_types:
        FAMILIES[model_type] = family
    return family


def family_of(hf_config) -> ModelFamily:
    """The family of a HF config (or a model: its .config), the generic one when no entry names it."""
    config = getattr(hf_config, "config", hf_config)
    return FAMILIES.get(getattr(config, "model_type", None), _GENERIC)


def fused_model_types() -> tuple[str, ...]:
    """The model_types the native engine's fused decoder runs."""
    return tuple(sorted(t for t, f in FAMILIES.items() if f.fused_decoder))


register_family(ModelFamily("llama", ("llama", "mistral")))
register_family(ModelFamily("qwen2", ("qwen2",)))
register_family(ModelFamily("qwen3", ("qwen3",)))  # q_norm / k_norm over head_dim: the plan and decoder handle them
