"""Decoder forwards for the native engine: logits of the last position given new tokens.

Two implementations behind one call, `decoder(input_ids, position_ids, key_valid, start)`, after
`decoder.reset(num_prompts, prompt_len, response_len, group_size)`:

* `FusedDecoder` -- our own forward for the Llama family (Qwen2, Qwen3, Llama, Mistral) over
  the weights of the HF modules it wraps. q/k/v and gate/up are fused into one matmul each,
  their HF parameters becoming views into the fused buffers (so `update_weights` by HF name
  still lands in place); rope comes from a cos/sin table built once per batch by the HF rotary
  module (every rope scaling HF knows), applied to q and k heads in one go (rope factors of
  every decode step gathered once per batch); a static `KVCache` per layer; prefill attention
  is `scaled_dot_product_attention`, decode attention two batched matmuls (GQA by grouping
  query heads per kv head; scale and padding mask folded into the first, a baddbmm).
  The decode step is built for per-op overhead, which is what a small model's step costs on
  CPU: it runs on (B, hidden) activations (no reshapes or transposes between ops), calls
  torch.mm / addmm on (in, out) weight views (the ops F.linear dispatches to, minus the
  dispatch), the RMSNorm op bound to its weight and the activation as a function, all looked
  up once per `_fuse` instead of through nn.Module attributes per step, and adds to the
  residual stream in place. lm_head runs on the last position only. Unmerged LoRA adapters
  (rollout.lora_merge=false) add x A^T B^T * scale beside the fused q/k/v and gate/up matmuls
  (`fuse_lora`, `add_lora`); adapted o/down projections run as their LoraLinear modules.
  Over a tensor-parallel group (rollout.tensor_model_parallel_size > 1) its decode step is
  `decode_step_tp` (decoder_tp.py).
* `HFDecoder` (hf_decoder.py) -- drives any HF causal LM with its own `DynamicCache` (any architecture).

Prefix sharing (group_size g > 1, rollout.native_prefix_sharing): the prefill runs on the distinct
prompts only and each prompt is decoded as g rows. "copy": the prefill's keys and values are written
to the caches of the prompt's g rows and decoding is as without sharing (bit for bit on CPU: the
prefill's row-wise matmuls give each prompt the values it gets when repeated, and lm_head runs on
the rows). "shared" (fused decoder): one prompt block per prompt (a (prompts, P) `KVCache`) and one
response block per row (a `GroupKVCache`, (rows, R)), attended with one softmax
(attention.shared_decode_attention): a step reads a prompt's keys once for its g rows, and the cache
holds prompts*P + rows*R slots instead of rows*(P+R). At the GRPO shape (8 prompts x 4 samples,
96-token prompts, 64 new tokens) sharing saves 3/4 of the prefill FLOPs, and "shared" 45% of the
cache. The HF decoder always copies (its cache expanded by index after the prefill).

Measured on CPU (bench/rollout.py: tiny model, batch 64, 128 new tokens, sampling, 1 thread) the
native engine with the fused decoder generates 3.6x faster than HF generate (wall and CPU time) and
2.6x faster than with the HF decoder, so "auto" picks it whenever the model is of the supported
family; greedy output of both equals HF generate token for token in fp32 (tests/test_rollout_native.py).

With rollout.native_compile the fused decode step (`FusedDecoder.decode_step`: every layer plus
lm_head for one token per row) runs under torch.compile (fullgraph; batch size and cache length
marked dynamic, so one graph serves every batch and step); a compile failure warns once and the
engine decodes eagerly. Prefill always runs eagerly (once per batch). On CPU (same bench) that
gains only ~7% over the eager step (3.9x HF generate) after a one-off compile of 4-30 s per
process: what is left is matmuls and the attention's reads of the cache, which compiling does
not shorten.

Shapes: B batch, T new tokens, S = start + T filled cache slots, V vocab.
key_valid (B, S) bool marks the slots that hold real tokens (left padding is False).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tinyzero.models.families import family_of, fused_model_types
from tinyzero.rollout.native.attention import (
    attention_mask,
    decode_attention,
    prefill_attention,
    shared_decode_attention,
)
from tinyzero.rollout.native.decoder_tp import TensorParallelDecoding
from tinyzero.rollout.native.fused_ops import (
    act_fn,
    add_lora,
    apply_rope,
    fuse_linears,
    fuse_lora,
    linear,
    mm,
    norm_fn,
    rms_norm,
    weight_t,
    wide_mm,
)
from tinyzero.rollout.native.hf_decoder import HFDecoder
from tinyzero.rollout.native.kv_cache import GroupKVCache, KVCache


def fused_supported(model: nn.Module) -> str | None:
    """None if the fused decoder can run this model, else the reason it cannot (the model families that
    declare it: tinyzero.models.families)."""
    cfg = model.config
    if not family_of(cfg).fused_decoder:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {fused_model_types()}"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (
        getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)
    ):
        return "sliding-window attention is not implemented by the fused decoder"
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return "sliding-window attention is not implemented by the fused decoder"
    attn = model.model.layers[0].self_attn
    if len({attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None}) != 1:
        return "q/k/v projections disagree on having a bias"
    return None


COMPACT_MIN_HIDDEN = 256
"""Hidden size from which the fused decoder computes only the rows still generating."""


class FusedDecoder(TensorParallelDecoding):
    """Static-KV-cache forward over the weights of a Llama-family HF model (see module docstring)."""

    def __init__(self, model: nn.Module, compile: bool = False):
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
        # A decode step may compute a subset of the rows (generate drops the stopped ones). That adds a few
        # gathers per layer, which only pay at a real model's width: at hidden 64 a step is per-op overhead
        # and dropping rows made generation slower (+7%, rows stopping after 32 of 96 tokens on average).
        self.takes_active_rows = cfg.hidden_size >= COMPACT_MIN_HIDDEN
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.caches: list[KVCache] = []  # per layer: every row's [prompt, response], or (shared) each prompt once
        self.group_caches: list[GroupKVCache] = []  # per layer, with prefix sharing: each row's response
        self.group_size = 1  # rows decoded per prefilled sequence (reset)
        self.shared_kv = False  # group_size > 1 with a shared prompt block (else rows hold copies)
        self.prompt_len = 0  # P of the current batch (reset)
        self.cos_table = self.sin_table = None  # (max_len, D): rope for every position, built in reset()
        self.key_bias = None  # (B * kv_heads, 1, P+R), shared: (Bp * kv_heads, 1, P) additive mask, begin()
        self.slot_ids = None  # (P+R,): with sharing, response slot t is passed as slot_ids[: P + t + 1] (a shape)
        self.step_pos = None  # (B, R) decode positions given to begin(); step_cos/step_sin: (R, B, 1, D)
        self.step_cos = self.step_sin = None
        self.step_start = 0  # the cache slot of decode step 0 (P): decode step t writes slot P + t
        self.fused: list[dict] = []
        # Tensor parallelism (set_tensor_parallel): the MLPs and lm_head split over the group, attention by rows.
        self.comm = None  # tp_comm.ShmComm / DistComm of the engine's tensor-parallel group
        self.tp_on = False  # this batch decodes tensor-parallel (reset)
        self.tp_prompts = self.tp_rows = (0, 0)  # [lo, hi) of the prompts / rows this rank attends for
        self.tp_lm_head_wt = None  # (hidden, vocabulary block) view of this rank's lm_head rows
        self.tp_vocab = (0, 0)  # (vocabulary, block size)
        self._fuse()
        # Batch size, cache length and slot are marked dynamic per call (_run_decode), so one compiled
        # graph serves every batch and step (no recompiles as the cache fills or a last chunk is smaller).
        self._compiled = torch.compile(self.decode_step, fullgraph=True) if compile else None

    def _fuse(self) -> None:
        """Fuse q/k/v and gate/up of every layer (again after a device move broke the sharing), and
        note per layer what the decode step reads: (in, out) weight views for torch.mm / addmm (the
        ops F.linear runs on 2-D input), the Qwen3 q/k norms and the attention scale."""
        self.fused = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            qkv_w, qkv_b = fuse_linears([a.q_proj, a.k_proj, a.v_proj])
            gate_up_w, _ = fuse_linears([m.gate_proj, m.up_proj])
            self.fused.append({
                "qkv_w": qkv_w, "qkv_b": qkv_b, "gate_up_w": gate_up_w,
                # Unmerged LoRA (rollout.lora_merge=false): adapters beside the fused projections.
                "qkv_lora": fuse_lora([a.q_proj, a.k_proj, a.v_proj]), "gate_up_lora": fuse_lora([m.gate_proj, m.up_proj]),
                "qkv_wt": qkv_w.t(), "gate_up_wt": gate_up_w.t(),
                "o_wt": weight_t(a.o_proj), "down_wt": weight_t(m.down_proj),
                "qk_norm": (a.q_norm, a.k_norm) if hasattr(a, "q_norm") else None,
                "scale": getattr(a, "scaling", None) or self.head_dim**-0.5,
                # Modules the decode step calls, looked up once (nn.Module attribute access is slow).
                "input_norm": norm_fn(layer.input_layernorm), "post_norm": norm_fn(layer.post_attention_layernorm),
                "act": act_fn(m.act_fn), "o_proj": a.o_proj, "down_proj": m.down_proj,
            })
        self.final_norm = norm_fn(self.norm)
        self.lm_head_wt = weight_t(self.lm_head)
        if self.comm is not None:
            self._fuse_tensor_parallel()

    def _fusion_intact(self) -> bool:
        if len(self.fused) != len(self.layers):
            return False
        views = [(self.lm_head, self.lm_head_wt)]
        for layer, f in zip(self.layers, self.fused):
            a, m = layer.self_attn, layer.mlp
            if a.q_proj.weight.data_ptr() != f["qkv_w"].data_ptr() or \
                    m.gate_proj.weight.data_ptr() != f["gate_up_w"].data_ptr() or \
                    a.v_proj.weight.data_ptr() != f["qkv_w"][-a.v_proj.weight.shape[0]:].data_ptr() or \
                    m.up_proj.weight.data_ptr() != f["gate_up_w"][m.gate_proj.weight.shape[0]:].data_ptr():
                return False
            views += [(a.o_proj, f["o_wt"]), (m.down_proj, f["down_wt"])]
        return all(view is None or module.weight.data_ptr() == view.data_ptr() for module, view in views)

    def reset(self, num_prompts: int, prompt_len: int, response_len: int, group_size: int = 1,
              shared_kv: bool = True) -> None:
        """Allocate (or reuse) the per-layer caches for a new batch of `num_prompts` left-padded prompts of
        `prompt_len` tokens, each decoded as `group_size` rows of up to `response_len` tokens. group_size 1:
        one cache of prompt_len + response_len slots per row. group_size > 1 (prefix sharing), shared_kv:
        one cache of prompt_len slots per prompt plus a response cache per row; not shared_kv: one cache
        per row as for group_size 1, the prefill's keys and values copied to the rows of their prompt."""
        if not self._fusion_intact():  # e.g. model.to(device) gave every parameter its own storage
            self._fuse()
        p = self.embed.weight
        shared = group_size > 1 and shared_kv
        max_len = prompt_len + response_len
        self.group_size, self.prompt_len, self.shared_kv = group_size, prompt_len, shared
        cache_len = prompt_len if shared else max_len
        self.tp_on = self._tp_ready() and num_prompts % self.comm.size == 0
        if self.tp_on:  # this rank's prompts (and their rows): the caches hold those only
            T, r = self.comm.size, self.comm.rank
            local = num_prompts // T
            self.tp_prompts, self.tp_rows = (r * local, (r + 1) * local), (r * local * group_size, (r + 1) * local * group_size)
            vocab, per = self.tp_vocab
            rows = num_prompts * group_size
            self.comm.reserve(p.element_size() * max(rows * per, local * group_size * vocab, rows * p.shape[1]))
            num_prompts = local
        if group_size > 1 and not shared:
            num_prompts *= group_size  # one cache entry per row

        def fits(c: torch.Tensor, shape: tuple[int, ...], len_dim: int) -> bool:
            return c.shape[:len_dim] == shape[:len_dim] and c.shape[len_dim] >= shape[len_dim] \
                and c.dtype == p.dtype and c.device == p.device

        KV, D = self.num_kv_heads, self.head_dim
        if not (self.caches and fits(self.caches[0].v_cache, (num_prompts, KV, cache_len), 2)):
            self.caches = []  # free the old ones before allocating
            self.caches = [KVCache(num_prompts, cache_len, KV, D, p.dtype, p.device) for _ in self.layers]
        if not shared:
            self.group_caches = []
        elif not (self.group_caches and fits(self.group_caches[0].v_cache, (num_prompts, KV, group_size, response_len), 3)):
            self.group_caches = []
            self.group_caches = [GroupKVCache(num_prompts, group_size, response_len, KV, D, p.dtype, p.device)
                                 for _ in self.layers]
        self.slot_ids = torch.arange(max_len, device=p.device)
        if self.cos_table is not None and self.cos_table.shape[0] >= max_len and self.cos_table.device == p.device \
                and self.cos_table.dtype == p.dtype:
            return
        # HF computes rope per position independently (inv_freq * pos in fp32), so a table is exact.
        positions = torch.arange(max_len, device=p.device)[None]
        cos, sin = self.rotary(torch.empty(0, dtype=p.dtype, device=p.device), positions)
        half = self.head_dim // 2
        self.cos_table = cos[0]
        self.sin_table = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # signed, see apply_rope

    def release(self) -> None:
        """Drop the caches and the fused buffers (re-fused from the parameters by the next reset)."""
        self.caches = []
        self.group_caches = []
        self.cos_table = self.sin_table = None
        self.key_bias = self.slot_ids = None
        self.step_pos = self.step_cos = self.step_sin = None
        self.fused = []

    def begin(self, key_valid: torch.Tensor, decode_positions: torch.Tensor | None = None) -> None:
        """Per batch: the additive attention bias (0 for valid slots, -inf for padding), one row per
        (sequence, kv head) as decode_attention wants it, (B * kv_heads, 1, P+R); with prefix sharing
        one row per (prompt, kv head) over the prompt slots only, (Bp * kv_heads, 1, P), taken from the
        first row of each prompt (the response slots all hold real tokens). And, given the positions
        (B, R) the decode steps will be fed (decode step t, at cache slot P + t, is fed
        `decode_positions[:, t]`), the rope factors of every step, gathered once instead of per step.
        key_valid: (B, P+R) per row."""
        own = key_valid
        if self.shared_kv:
            own = key_valid[:: self.group_size, : self.prompt_len]
            if self.tp_on:
                own = own[self.tp_prompts[0]:self.tp_prompts[1]]
        elif self.tp_on:
            own = key_valid[self.tp_rows[0]:self.tp_rows[1]]
        bias = torch.zeros(own.shape, dtype=self.embed.weight.dtype, device=key_valid.device)
        bias.masked_fill_(~own, float("-inf"))
        self.key_bias = bias.repeat_interleave(self.num_kv_heads, dim=0)[:, None]
        self.step_pos = self.step_cos = self.step_sin = None
        if decode_positions is not None and self.cos_table is not None:
            pos_t = decode_positions.t()  # (R, B)
            self.step_cos = self.cos_table[pos_t][:, :, None]  # (R, B, 1, D)
            self.step_sin = self.sin_table[pos_t][:, :, None]
            self.step_pos = decode_positions
            self.step_start = key_valid.shape[1] - decode_positions.shape[1]

    def _rope(self, position_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed_sin (B, T, D) for position_ids (B, T) fed at cache slot `start`: for decode step
        t = start - P of a batch begin() was given the positions of, the factors it gathered (that step
        is fed decode_positions[:, t], begin's contract); else a table lookup."""
        sp = self.step_pos
        if sp is not None and position_ids.shape == (sp.shape[0], 1):
            t = start - self.step_start
            if 0 <= t < sp.shape[1]:
                return self.step_cos[t], self.step_sin[t]
        return self.cos_table[position_ids], self.sin_table[position_ids]

    def _attention(self, layer_idx: int, attn: nn.Module, x: torch.Tensor, cos, sin, mask, start: int):
        B, T, _ = x.shape
        H, KV = self.num_heads, self.num_kv_heads
        f = self.fused[layer_idx]
        qkv = add_lora(F.linear(x, f["qkv_w"], f["qkv_b"]), x, f["qkv_lora"]).view(B, T, H + 2 * KV, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before rope
            qk = torch.cat([rms_norm(attn.q_norm, qkv[:, :, :H]), rms_norm(attn.k_norm, qkv[:, :, H:H + KV])],
                           dim=2)
        else:
            qk = qkv[:, :, :H + KV]
        qk = apply_rope(qk.transpose(1, 2), cos[:, None], sin[:, None])  # (B, H + KV, T, D): q and k heads at once
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, :, H + KV:].transpose(1, 2)  # (B, KV, T, D)
        g = self.group_size
        if g > 1 and not self.shared_kv:  # prefix sharing by copy: rows i*g .. i*g+g-1 get prompt i's keys
            cache = self.caches[layer_idx]
            cache.update(start, k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0))
            k_t, v_all = cache.k_cache[::g, ..., : start + T], cache.v_cache[::g, :, : start + T]
        else:
            k_t, v_all = self.caches[layer_idx].update(start, k, v)  # (B, kv, D, S), (B, kv, S, D)
        scale = getattr(attn, "scaling", None) or self.head_dim**-0.5
        out = prefill_attention(q, k_t.transpose(-1, -2), v_all, mask, scale)
        return linear(attn.o_proj, out.transpose(1, 2).reshape(B, T, -1))

    def _qkv_decode(self, f: dict, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step's projections: x (B, hidden) -> (q and k heads after rope (B, H + KV, D),
        q/k/v (B, H + 2 * KV, D) whose last KV heads are v)."""
        B = x.shape[0]
        H, KV = self.num_heads, self.num_kv_heads
        qkv = torch.mm(x, f["qkv_wt"]) if f["qkv_b"] is None else torch.addmm(f["qkv_b"], x, f["qkv_wt"])
        qkv = add_lora(qkv, x, f["qkv_lora"]).view(B, H + 2 * KV, self.head_dim)
        if f["qk_norm"] is not None:  # Qwen3: per-head RMSNorm before rope
            q_norm, k_norm = f["qk_norm"]
            qk = torch.cat([rms_norm(q_norm, qkv[:, :H]), rms_norm(k_norm, qkv[:, H:H + KV])], dim=1)
        else:
            qk = qkv[:, :H + KV]
        return apply_rope(qk, cos, sin), qkv  # q and k heads rotated at once

    def _attention_decode(self, f: dict, x: torch.Tensor, cos, sin, bias, kv: tuple[torch.Tensor, torch.Tensor],
                          active: torch.Tensor | None = None):
        """One new token per sequence, everything 2-D or 3-D: f this layer's `_fuse` entry; x (B, hidden);
        cos, sin (B, 1, D); bias (B * kv_heads, 1, S) with S = slot + 1; kv this layer's cache tensors
        (KVCache layout). Batched matmuls (decode_attention) beat sdpa's overhead here. With `active`
        (see decode_step) x, cos, sin and the result hold the active rows only."""
        H, KV = self.num_heads, self.num_kv_heads
        slot = bias.shape[-1] - 1  # a shape, so a compiled step sees it as a symbolic size
        qk, qkv = _all_rows(self._qkv_decode(f, x, cos, sin), active, kv[0].shape[0])
        k_cache, v_cache = kv  # KVCache.update for one slot, inlined (they are graph inputs when compiled)
        k_cache.select(3, slot).copy_(qk[:, H:])  # select+copy_: a symbolic slot is not specialized
        v_cache.select(2, slot).copy_(qkv[:, H + KV:])
        k_t, v_all = k_cache[..., : slot + 1], v_cache[:, :, : slot + 1]
        out = decode_attention(qk[:, :H], k_t, v_all, bias, f["scale"])
        return mm(out if active is None else out[active], f["o_wt"], f["o_proj"])

    def _attention_decode_shared(self, f: dict, x: torch.Tensor, cos, sin, bias, slots: torch.Tensor,
                                 kv: tuple[torch.Tensor, torch.Tensor], group_kv: tuple[torch.Tensor, torch.Tensor],
                                 active: torch.Tensor | None = None):
        """`_attention_decode` with prefix sharing: bias (Bp * kv_heads, 1, P) over the prompt slots; kv this
        layer's prompt cache (KVCache layout, one entry per prompt), group_kv its response cache
        (GroupKVCache layout). The step writes response slot t = len(slots) - P - 1."""
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        P = bias.shape[-1]
        t = slots.shape[0] - P - 1  # shapes, so a compiled step sees them as symbolic sizes
        k_resp, v_resp = group_kv
        Bp, g = k_resp.shape[0], k_resp.shape[2]
        qk, qkv = _all_rows(self._qkv_decode(f, x, cos, sin), active, Bp * g)
        # Row i*g + j -> [i, :, j]: (B, KV, D) viewed (Bp, g, KV, D), kv heads moved in front of the rows.
        k_resp.select(4, t).copy_(qk[:, H:].view(Bp, g, KV, D).transpose(1, 2))
        v_resp.select(3, t).copy_(qkv[:, H + KV:].view(Bp, g, KV, D).transpose(1, 2))
        k_prompt, v_prompt = kv
        out = shared_decode_attention(qk[:, :H], k_prompt[..., :P], v_prompt[:, :, :P], k_resp[..., : t + 1],
                                      v_resp[:, :, :, : t + 1], bias, f["scale"])
        return mm(out if active is None else out[active], f["o_wt"], f["o_proj"])

    def _mlp(self, layer_idx: int, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        f = self.fused[layer_idx]
        gate, up = add_lora(F.linear(x, f["gate_up_w"]), x, f["gate_up_lora"]).chunk(2, dim=-1)
        return linear(mlp.down_proj, mlp.act_fn(gate) * up)

    def _mlp_decode(self, f: dict, x: torch.Tensor) -> torch.Tensor:
        """x (B, hidden): torch.mm on the fused gate/up view; the activation's fresh output takes the
        product in place."""
        gate, up = add_lora(wide_mm(x, f["gate_up_wt"]), x, f["gate_up_lora"]).chunk(2, dim=-1)
        return mm(f["act"](gate).mul_(up), f["down_wt"], f["down_proj"])

    def decode_step(self, token: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor,
                    kv: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor | None = None,
                    group_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    active: torch.Tensor | None = None) -> torch.Tensor:
        """The whole decode step as one function (what `compile=True` hands to torch.compile):
        token (B,), cos / sin (B, 1, D), bias (B * kv_heads, 1, slot + 1), kv the (k_cache, v_cache)
        tensors of every layer -> logits (B, V) fp32; writes this step's keys and values at `slot`.
        With prefix sharing (group_kv given): bias (Bp * kv_heads, 1, P), kv the prompt caches, group_kv
        the response caches, slots a tensor of length P + t + 1 for response slot t.
        active: None, or the (A,) ascending indices of the rows still generating; then only those rows
        go through the projections, the MLPs and lm_head (logits (A, V)), while attention runs on every
        row's cache (the others get zero keys and values at this slot: rows that stopped are not read again).
        The residual stream x is a fresh tensor (the embedding's output), so it is added to in place."""
        if active is not None:
            token, cos, sin = token[active], cos[active], sin[active]
        x = F.embedding(token, self.embed.weight)  # (B or A, hidden)
        for i, (f, layer_kv) in enumerate(zip(self.fused, kv)):
            h = f["input_norm"](x)
            if group_kv is None:
                x.add_(self._attention_decode(f, h, cos, sin, bias, layer_kv, active))
            else:
                x.add_(self._attention_decode_shared(f, h, cos, sin, bias, slots, layer_kv, group_kv[i], active))
            x.add_(self._mlp_decode(f, f["post_norm"](x)))
        return mm(self.final_norm(x), self.lm_head_wt, self.lm_head).float()

    def _run_decode(self, token, cos, sin, bias, slots: torch.Tensor | None = None,
                    active: torch.Tensor | None = None) -> torch.Tensor:
        """decode_step, compiled when asked; a compile failure warns once and the step runs eagerly
        from then on (the failed call is redone eagerly: it rewrites the same cache slot). slots: the
        prefix-sharing step's slot marker (see decode_step), None without sharing; active: see decode_step."""
        kv = [(c.k_cache, c.v_cache) for c in self.caches]
        args: tuple = (token, cos, sin, bias, kv)
        if slots is None:
            if bias.shape[-1] > self.caches[0].max_len:
                raise ValueError(f"KV cache overflow: writing slot {bias.shape[-1] - 1} of {self.caches[0].max_len}")
        else:
            t = slots.shape[0] - bias.shape[-1] - 1
            if t >= self.group_caches[0].max_len:
                raise ValueError(f"KV cache overflow: writing response slot {t} of {self.group_caches[0].max_len}")
            args += (slots, [(c.k_cache, c.v_cache) for c in self.group_caches])
        args += (None, None, active) if slots is None else (active,)
        if self.tp_on:
            return self.decode_step_tp(*args)
        if self._compiled is None:
            return self.decode_step(*args)
        if token.shape[0] > 1:  # batch and cache length symbolic: one graph for every batch and step
            for x in (token, cos, sin):
                torch._dynamo.mark_dynamic(x, 0)
        for x, dim in ((bias, 0), (bias, 2), (slots, 0), (active, 0)):
            if x is not None and x.shape[dim] > 1:
                torch._dynamo.mark_dynamic(x, dim)
        try:
            return self._compiled(*args)
        except Exception as exc:  # noqa: BLE001 -- any compiler failure falls back to eager
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            warnings.warn(f"rollout.native_compile: torch.compile of the decode step failed ({type(exc).__name__}: "
                          f"{first}); decoding eagerly", stacklevel=2)
            self._compiled = None
            return self.decode_step(*args)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, key_valid: torch.Tensor,
                 start: int, active: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, position_ids: (B, T) -> logits (B, V) of the last new position; a prefill with
        group_size > 1 returns (B * group_size, V), the logits of every row. A decode step (T = 1) given
        `active` (A,) row indices computes those rows only and returns (A, V) (see decode_step)."""
        cos, sin = self._rope(position_ids, start)  # (B, T, D) each
        if input_ids.shape[1] == 1 and self.shared_kv:  # decode against a shared prompt block
            if self.key_bias is None:
                self.begin(key_valid)
            return self._run_decode(input_ids.view(-1), cos, sin, self.key_bias, self.slot_ids[: key_valid.shape[1]],
                                    active)
        if input_ids.shape[1] == 1:  # decode: (B, hidden) activations, no per-op reshapes
            kb = self.key_bias
            rows = self.tp_rows[1] - self.tp_rows[0] if self.tp_on else key_valid.shape[0]
            if kb is None or kb.shape[0] != rows * self.num_kv_heads or kb.shape[2] < key_valid.shape[1]:
                self.begin(key_valid)
                kb = self.key_bias
            bias = kb[..., : key_valid.shape[1]]  # (B * kv_heads, 1, S)
            return self._run_decode(input_ids.view(-1), cos, sin, bias, None, active)
        if self.tp_on:  # prefill this rank's prompts with the whole weights; every rank gets every row's logits
            lo, hi = self.tp_prompts
            input_ids, key_valid, cos, sin = input_ids[lo:hi], key_valid[lo:hi], cos[lo:hi], sin[lo:hi]
        x = F.embedding(input_ids, self.embed.weight)  # (B, T, H)
        mask = attention_mask(key_valid, start, input_ids.shape[1])
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer.self_attn, rms_norm(layer.input_layernorm, x), cos, sin, mask, start)
            x = x + self._mlp(i, layer.mlp, rms_norm(layer.post_attention_layernorm, x))
        h = x[:, -1]
        if self.group_size > 1:  # one row per sample: lm_head then runs on the shape it has without sharing
            h = h.repeat_interleave(self.group_size, dim=0)  # (small-M matmuls round differently per M)
        logits = linear(self.lm_head, rms_norm(self.norm, h))
        if self.tp_on:
            logits = self.comm.all_gather(logits).view(-1, logits.shape[1])
        return logits.float()


def _all_rows(tensors: tuple[torch.Tensor, ...], active: torch.Tensor | None, rows: int) -> tuple[torch.Tensor, ...]:
    """The active rows' tensors (A, ...) placed at their rows of zero tensors (rows, ...); as they are
    without `active`."""
    if active is None:
        return tensors
    return tuple(t.new_zeros((rows, *t.shape[1:])).index_copy_(0, active, t) for t in tensors)


def build_decoder(model: nn.Module, impl: str = "auto", compile: bool = False):
    """"fused", "hf", or "auto" (fused when the model family is supported). `compile` compiles the
    fused decoder's decode step (the HF decoder always runs eagerly)."""
    if impl == "hf" or (impl == "auto" and fused_supported(model) is not None):
        return HFDecoder(model)
    return FusedDecoder(model, compile=compile)
