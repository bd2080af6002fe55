"""Attention for the native engine's fused decoder: the prefill mask and attention, the decode-step attentions.

A decode step has one query per row. `decode_attention` runs it over each row's own cache;
`shared_decode_attention` over a prompt block shared by the rows of one prompt plus each row's
response block (prefix sharing: a prompt's n samples prefill once and read its keys once per step).

Shapes: B rows, H query heads, KV kv heads (G = H / KV query heads per kv head), D head_dim,
S filled cache slots; with sharing Bp prompts of g rows each (B = Bp * g, row i*g + j is sample j of
prompt i), P prompt slots, T filled response slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def decode_attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence over the cache, GQA by grouping query heads per kv head.

    q: (B, heads, D); k_t: (B, kv_heads, D, S); v: (B, kv_heads, S, D); bias: (B * kv_heads, 1, S)
    additive -> (B, heads * D). The scale and the bias ride on the scores matmul (baddbmm)."""
    B, H, D = q.shape
    KV, S = k_t.shape[1], k_t.shape[3]
    if q.dtype == torch.float32:
        scores = torch.baddbmm(bias, q.reshape(B * KV, H // KV, D), k_t.reshape(B * KV, D, S), alpha=scale)
        probs = scores.softmax(dim=-1)  # (B * kv, heads / kv, S)
    else:  # half precision: scores and softmax in fp32
        scores = torch.bmm(q.reshape(B * KV, H // KV, D), k_t.reshape(B * KV, D, S))
        probs = scores.float().mul_(scale).add_(bias).softmax(dim=-1).to(v.dtype)
    return torch.bmm(probs, v.reshape(B * KV, S, D)).view(B, H * D)


def shared_decode_attention(q: torch.Tensor, k_prompt: torch.Tensor, v_prompt: torch.Tensor, k_resp: torch.Tensor,
                            v_resp: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row over its prompt's shared keys and its own response keys, one softmax over both.

    q: (B, H, D); k_prompt: (Bp, KV, D, P); v_prompt: (Bp, KV, P, D); k_resp: (Bp, KV, g, D, T);
    v_resp: (Bp, KV, g, T, D); bias: (Bp * KV, 1, P) additive prompt-padding mask (every response
    slot is a real token) -> (B, H * D). The queries of a prompt's g rows and G heads per kv head form
    one (g * G, D) block, so the prompt part is one matmul per (prompt, kv head) that reads the
    prompt's keys and values once for all g rows; the response part is one matmul per (row, kv head).
    Equals decode_attention over the rows' concatenated [prompt, response] caches up to fp rounding
    (the sums over slots are split in two)."""
    B, H, D = q.shape
    Bp, KV, g, _, T = k_resp.shape
    P, G = k_prompt.shape[-1], H // KV
    kp, vp = k_prompt.reshape(Bp * KV, D, P), v_prompt.reshape(Bp * KV, P, D)
    kr, vr = k_resp.reshape(Bp * KV * g, D, T), v_resp.reshape(Bp * KV * g, T, D)
    if q.dtype == torch.float32:  # the scale rides on the copy that groups the queries
        qg = (q.view(Bp, g, KV, G, D).transpose(1, 2) * scale).reshape(Bp * KV, g * G, D)  # rows of a prompt
        s_prompt = torch.baddbmm(bias, qg, kp)  # (Bp*KV, g*G, P)
        s_resp = torch.bmm(qg.view(Bp * KV * g, G, D), kr)  # (Bp*KV*g, G, T)
    else:  # half precision: scores and softmax in fp32
        qg = q.view(Bp, g, KV, G, D).transpose(1, 2).reshape(Bp * KV, g * G, D)
        s_prompt = torch.bmm(qg, kp).float().mul_(scale).add_(bias)
        s_resp = torch.bmm(qg.view(Bp * KV * g, G, D), kr).float().mul_(scale)
    scores = torch.cat([s_prompt.view(Bp * KV, g, G, P), s_resp.view(Bp * KV, g, G, T)], dim=-1)
    probs = scores.softmax(dim=-1).to(v_prompt.dtype)  # (Bp*KV, g, G, P+T)
    out = torch.bmm(probs[..., :P].reshape(Bp * KV, g * G, P), vp)  # (Bp*KV, g*G, D)
    out = torch.baddbmm(out.view(Bp * KV * g, G, D), probs[..., P:].reshape(Bp * KV * g, G, T), vr)
    return out.view(Bp, KV, g, G, D).transpose(1, 2).reshape(B, H * D)


def sdpa_takes_grouped_kv(device_type: str) -> bool:
    """Whether SDPA with a mask should get grouped kv heads as they are (`enable_gqa`) on this device.

    CPU: yes, its kernel takes them. CUDA: no: with a mask and enable_gqa, SDPA's flash and memory-efficient
    kernels decline and the math kernel materialises the (rows, heads, L, L) fp32 scores, so long prompts
    run out of memory; the kv heads are repeated instead (as workers/packing.py does). Which kernel SDPA
    picks can only be seen on a GPU (scripts/gpu_check.py's bench_rollout runs the prefill there).
    """
    return device_type != "cuda"


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, grouped_kv: bool | None = None) -> torch.Tensor:
    """SDPA over a prefill: q (B, H, T, D), k / v (B, KV, S, D), mask (B, 1, T, S) -> (B, H, T, D).
    `grouped_kv` None decides by the device (sdpa_takes_grouped_kv)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if grouped_kv is None:
        grouped_kv = sdpa_takes_grouped_kv(q.device.type)
    if heads != kv_heads and not grouped_kv:
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=heads != k.shape[1])
