"""Decoder forwards for the native engine: logits of the last position given new tokens.

Two implementations behind one call, `decoder(input_ids, position_ids, key_valid, start)`:

* `FusedDecoder` -- our own forward for the Llama family (Qwen2, Qwen3, Llama, Mistral) that
  reads the weights of the HF modules it wraps: RMSNorm and the SwiGLU MLP are the HF
  modules themselves, rotary cos/sin come from the HF rotary module (so every rope scaling
  HF knows is honoured), and attention is ours: q/k/v projections, rope, a static
  `KVCache` per layer and `scaled_dot_product_attention` (GQA) over the filled slots.
  lm_head runs on the last position only.
* `HFDecoder` -- drives any HF causal LM with its own `DynamicCache` (any architecture).

Measured on CPU (bench/rollout.py, tiny model, batch 64, 128 new tokens) the fused decoder
is the faster one, so "auto" picks it whenever the model is of the supported family.

Shapes: B batch, T new tokens, S = start + T filled cache slots, V vocab.
key_valid (B, S) bool marks the slots that hold real tokens (left padding is False).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyzero.rollout.kv_cache import KVCache

FUSED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, D); cos/sin: (B, T, D)."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def attention_mask(key_valid: torch.Tensor, start: int, num_new: int) -> torch.Tensor:
    """Boolean (B, 1, T, S) mask: query at slot start+i sees valid keys at slots <= start+i.

    A padded query slot also sees itself, so no row is fully masked (its output is unused)."""
    slots = key_valid.shape[1]
    q_slot = torch.arange(start, start + num_new, device=key_valid.device)  # (T,)
    k_slot = torch.arange(slots, device=key_valid.device)  # (S,)
    causal = k_slot[None, :] <= q_slot[:, None]  # (T, S)
    mask = causal[None] & key_valid[:, None, :]  # (B, T, S)
    mask = mask | (k_slot[None, :] == q_slot[:, None])[None]
    return mask.unsqueeze(1)


def fused_supported(model: nn.Module) -> str | None:
    """None if the fused decoder can run this model, else the reason it cannot."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FUSED_MODEL_TYPES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {FUSED_MODEL_TYPES}"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (
        getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)
    ):
        return "sliding-window attention is not implemented by the fused decoder"
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return "sliding-window attention is not implemented by the fused decoder"
    return None


class FusedDecoder:
    """Static-KV-cache forward over the weights of a Llama-family HF model (see module docstring)."""

    def __init__(self, model: nn.Module):
        reason = fused_supported(model)
        if reason is not None:
            raise ValueError(f"fused decoder unavailable: {reason}; set rollout.native_impl='hf'")
        self.model = model
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.caches: list[KVCache] = []

    def reset(self, batch_size: int, max_len: int) -> None:
        """Allocate (or reuse) the per-layer caches for a new batch."""
        p = self.embed.weight
        if self.caches and self.caches[0].k_cache.shape[0] == batch_size and self.caches[0].max_len >= max_len \
                and self.caches[0].k_cache.dtype == p.dtype and self.caches[0].k_cache.device == p.device:
            return
        self.caches = []  # free the old ones before allocating
        self.caches = [KVCache(batch_size, max_len, self.num_kv_heads, self.head_dim, p.dtype, p.device)
                       for _ in self.layers]

    def release(self) -> None:
        self.caches = []

    def _attention(self, layer_idx: int, attn: nn.Module, x: torch.Tensor, cos, sin, mask, start: int):
        B, T, _ = x.shape
        q = attn.q_proj(x).view(B, T, -1, self.head_dim)
        k = attn.k_proj(x).view(B, T, -1, self.head_dim)
        v = attn.v_proj(x).view(B, T, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before rope
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_all, v_all = self.caches[layer_idx].update(start, k, v)  # (B, kv_heads, S, D)
        out = F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, scale=getattr(attn, "scaling", None),
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # (B, heads, T, D)
        return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, key_valid: torch.Tensor,
                 start: int) -> torch.Tensor:
        """input_ids, position_ids: (B, T) -> logits (B, V) of the last new position."""
        x = self.embed(input_ids)  # (B, T, H)
        cos, sin = self.rotary(x, position_ids)  # (B, T, D) each
        mask = attention_mask(key_valid, start, input_ids.shape[1])
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer.self_attn, layer.input_layernorm(x), cos, sin, mask, start)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x[:, -1])).float()


class HFDecoder:
    """Drives the HF model itself with a DynamicCache: slower, but runs any causal LM."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache = None

    def reset(self, batch_size: int, max_len: int) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def release(self) -> None:
        self.cache = None

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, key_valid: torch.Tensor,
                 start: int) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=key_valid.long(), position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[:, -1].float()


def build_decoder(model: nn.Module, impl: str = "auto"):
    """"fused", "hf", or "auto" (fused when the model family is supported)."""
    if impl == "hf" or (impl == "auto" and fused_supported(model) is not None):
        return HFDecoder(model)
    return FusedDecoder(model)
