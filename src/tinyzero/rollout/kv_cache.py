"""Preallocated (static) key/value cache for one decoder layer, in the style of gpt-fast.

Prompts are left-padded to one length P, so at every step all sequences write the same
cache slot: slot s holds position s of the padded sequence. `update(start, k, v)` writes
slots [start, start + T) and returns views of the filled slots [0, start + T) for attention;
padded slots are hidden by the attention mask, never by moving data. Keys are stored
transposed, (batch, kv_heads, head_dim, max_len), so the decode step's q @ k^T reads
a (head_dim, S) operand with unit stride along S (about 1.5x faster batched matmul on CPU).
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys (batch, kv_heads, head_dim, max_len) and values (batch, kv_heads, max_len, head_dim) of one layer."""

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        k_shape = (batch_size, num_kv_heads, head_dim, max_len)
        v_shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(k_shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(v_shape, dtype=dtype, device=device), persistent=False)
        if batch_size > 1:  # a compiled decode step treats batch and length as symbolic (no-op in eager)
            torch._dynamo.mark_dynamic(self.k_cache, 0)
            torch._dynamo.mark_dynamic(self.v_cache, 0)
        if max_len > 1:
            torch._dynamo.mark_dynamic(self.k_cache, 3)
            torch._dynamo.mark_dynamic(self.v_cache, 2)

    @property
    def max_len(self) -> int:
        return self.v_cache.shape[2]

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (batch, kv_heads, T, head_dim) at slots [start, start+T); return the filled prefix
        as (k^T (batch, kv_heads, head_dim, S), v (batch, kv_heads, S, head_dim)), S = start + T."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: writing up to slot {end} of {self.max_len}")
        self.k_cache[..., start:end] = k.transpose(-1, -2)
        self.v_cache[:, :, start:end] = v
        return self.k_cache[..., :end], self.v_cache[:, :, :end]

    def append(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step's update: write k, v (batch, kv_heads, head_dim) at `slot`; return the filled
        prefix as in `update`, S = slot + 1."""
        if slot >= self.max_len:
            raise ValueError(f"KV cache overflow: writing slot {slot} of {self.max_len}")
        self.k_cache[..., slot] = k
        self.v_cache[:, :, slot] = v
        return self.k_cache[..., : slot + 1], self.v_cache[:, :, : slot + 1]
