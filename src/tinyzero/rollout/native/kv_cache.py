"""Preallocated (static) key/value cache for one decoder layer, in the style of gpt-fast.

Prompts are left-padded to one length P, so at every step all sequences write the same
cache slot: slot s holds position s of the padded sequence. `update(start, k, v)` writes
slots [start, start + T) and returns views of the filled slots [0, start + T) for attention;
padded slots are hidden by the attention mask, never by moving data. Keys are stored
transposed, (batch, kv_heads, head_dim, max_len), so the decode step's q @ k^T reads
a (head_dim, S) operand with unit stride along S (about 1.5x faster batched matmul on CPU).

With prefix sharing (a prompt's n samples decoded against one prefill), a `KVCache` holds
each distinct prompt once and a `GroupKVCache` holds each row's own response tokens, with
the rows of one prompt next to each other under every kv head (see decoder.py).
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


class GroupKVCache(nn.Module):
    """Response keys (prompts, kv_heads, group, head_dim, max_len) and values (prompts, kv_heads, group,
    max_len, head_dim) of one layer: row j of prompt i (batch row i*group + j) at [i, :, j]. Keeping a
    prompt's rows together under each kv head lets one batched matmul read that prompt's shared keys
    for all of its rows' queries (decoder.shared_decode_attention)."""

    def __init__(self, num_prompts: int, group_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        k_shape = (num_prompts, num_kv_heads, group_size, head_dim, max_len)
        v_shape = (num_prompts, num_kv_heads, group_size, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(k_shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(v_shape, dtype=dtype, device=device), persistent=False)
        for dim in (0, 2):  # a compiled decode step treats prompts, group and length as symbolic
            if k_shape[dim] > 1:
                torch._dynamo.mark_dynamic(self.k_cache, dim)
                torch._dynamo.mark_dynamic(self.v_cache, dim)
        if max_len > 1:
            torch._dynamo.mark_dynamic(self.k_cache, 4)
            torch._dynamo.mark_dynamic(self.v_cache, 3)

    @property
    def max_len(self) -> int:
        return self.v_cache.shape[3]
