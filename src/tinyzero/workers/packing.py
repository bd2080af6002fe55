"""Packed forward passes: no padding computed, and a group's shared prompt computed once.

A rollout batch is (rows, P + R): left-padded prompts, right-padded responses. Packing lays
the real tokens of several sequences side by side in fewer, shorter rows and gives the model
a 4-D attention mask (rows, 1, L, L) that keeps them apart:

- "remove_padding" (veRL's `use_remove_padding`): every sequence is one segment; a token sees
  the earlier tokens of its own segment (a block-diagonal causal mask).
- "shared_prefix": rows whose prompts are identical (the n samples of one GRPO group, rows from
  `batch.repeat(n, interleave=True)`) become one unit [prompt, response_1 .. response_n].
  Each response token sees the prompt and the earlier tokens of its own response, never another
  response. Position ids are the rows' own: the prompt's, then prompt length + t for response
  token t, restarting for every response. The prompt is thus computed once per group, forward
  and backward, and its gradient is the sum of the per-sample ones, as in the unpacked batch.

Groups are found by comparing the prompts (valid tokens and their positions), not by `uid`:
identical prompt tokens at identical positions give identical hidden states, so sharing them is
exact whatever the rows' origin, and a group split across micro-batches or data-parallel ranks
simply has its prompt computed once in each place it landed.

The hidden state that predicts response token t is the previous real token's: the prompt's
last token for t = 0, response position t-1 otherwise (`hidden_index`, into the flattened
(rows * L) hidden states). Results at response positions that are padding are 0, as for the
columns `trim_padding` cuts.

Units are placed into rows first-fit-decreasing with a row length of the longest unit, so
attention (dense over each packed row with SDPA) costs about what the longest sequence costs.
For dense masks a group longer than DENSE_ROW_TOKENS is cut into several units, each with its own
copy of the prompt, which bounds the L x L mask (a single longer sequence keeps its own row).

Attention backends: the mask goes to the HF model as a custom 4-D mask, which transformers uses
as-is (masking_utils._preprocess_mask_arguments). Eager takes it as an additive float mask,
flex_attention as a BlockMask built from the same rule (`mask_mod`), which skips the fully masked
blocks and never materialises L x L. SDPA models are switched to "tinyzero_packed_sdpa"
(`packed_sdpa_attention`): it attends segment by segment instead of over the whole row. Each
segment's queries meet only the keys they may see (its prompt's tokens, then its own), gathered
into two small padded batches (`attention_blocks`: the segments that see a prompt, the ones that do
not). A row holding a 90-token prompt and sixteen 200-token responses then costs about
16 x 200 x 290 + 90 x 90 scores instead of 3290 x 3290, forward and backward. Without the blocks (a
call that does not pass them) it is HF's SDPA with the dense boolean mask. `model_mask` also keeps the
dense mask where the blocks would hold more than BLOCKS_WORTH of the row's L x L scores: there the
gathering and the smaller kernel calls cost about what they save (four 48-token samples on a
90-token prompt, bench/packed_attention.py). Padding positions get 0 from the blocks. flash_attention_2/3
cannot take a custom mask, so `prepare_attention` switches a packed model to SDPA with a warning.
Tested: SDPA end to end on CPU (fp32), and the BlockMask's rule and a flex_attention call against
the dense mask on CPU. Untested here: everything on GPU (the same code; on GPU set
model.attn_implementation=flex_attention for block-sparse attention, as SDPA with a dense mask
computes the masked blocks and holds L x L booleans per packed row), and flex_attention inside the
HF model (transformers compiles it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PACKED_ATTENTION = "tinyzero_packed_sdpa"
_MASKED_ATTENTION = ("sdpa", "eager", "flex_attention", "ulysses_sdpa", PACKED_ATTENTION)  # ulysses_sdpa: models.ulysses
DENSE_ROW_TOKENS = 4096
BLOCKS_WORTH = 0.5  # packed SDPA takes the segment blocks when they hold at most this share of the L x L scores


Packing = Literal["none", "remove_padding", "shared_prefix"]
PACKINGS = get_args(Packing)


def packing_mode(model_config) -> Packing:
    """The packing a model config asks for (its use_shared_prefix / use_remove_padding, veRL's names):
    shared_prefix, remove_padding or none."""
    if getattr(model_config, "use_shared_prefix", False):
        return "shared_prefix"
    return "remove_padding" if getattr(model_config, "use_remove_padding", False) else "none"


def prepare_attention(model: nn.Module, mode: str) -> None:
    """Switch a model that will run packed to an attention kernel that takes a custom 4-D mask."""
    if mode == "none":
        return
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl not in _MASKED_ATTENTION:
        logger.warning("packed training needs attention with a custom 4-D mask; switching %s from %s to sdpa",
                       type(model).__name__, impl)
        impl = "sdpa"
    if impl == "sdpa":
        register_packed_attention()
        impl = PACKED_ATTENTION
    if impl != getattr(model.config, "_attn_implementation", "sdpa"):
        model.set_attn_implementation(impl)


def uses_attention_blocks(model: nn.Module) -> bool:
    """Whether the model's attention takes `attention_blocks` (packed_sdpa_attention). Models with
    sliding-window layers take the dense mask instead (the blocks carry no window)."""
    config = model.config
    sliding = any("sliding" in str(t) for t in (getattr(config, "layer_types", None) or ())) or bool(
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))
    return getattr(config, "_attn_implementation", None) == PACKED_ATTENTION and not sliding


@dataclass
class AttentionBlock:
    """Segments attended to in one padded batch: S segments, Lq query slots, Lk key slots each."""

    q_index: torch.Tensor  # (S, Lq) flattened (rows * L) position of each query slot (0 at padding)
    q_valid: torch.Tensor  # (S, Lq) bool
    kv_index: torch.Tensor  # (S, Lk) the prompt's tokens, then the segment's own
    mask: torch.Tensor  # (S, 1, Lq, Lk) bool, True = may attend
    out_index: torch.Tensor  # (valid slots,) q_index[q_valid]

    def to(self, device) -> AttentionBlock:
        return AttentionBlock(*(t.to(device) for t in (self.q_index, self.q_valid, self.kv_index, self.mask,
                                                        self.out_index)))


def _attention_block(queries: list[torch.Tensor], prefixes: list[torch.Tensor] | None) -> AttentionBlock:
    """One padded batch: segment i's queries see prefixes[i] whole and its own earlier tokens."""
    s, lq = len(queries), max(len(q) for q in queries)
    lp = max(len(p) for p in prefixes) if prefixes else 0
    q_index = torch.zeros(s, lq, dtype=torch.long)
    q_valid = torch.zeros(s, lq, dtype=torch.bool)
    kv_index = torch.zeros(s, lp + lq, dtype=torch.long)
    kv_valid = torch.zeros(s, lp + lq, dtype=torch.bool)
    for i, q in enumerate(queries):
        q_index[i, :len(q)], q_valid[i, :len(q)] = q, True
        kv_index[i, lp:lp + len(q)], kv_valid[i, lp:lp + len(q)] = q, True
        if prefixes:
            kv_index[i, :len(prefixes[i])], kv_valid[i, :len(prefixes[i])] = prefixes[i], True
    slot = torch.arange(lq)
    mask = kv_valid[:, None, :].repeat(1, lq, 1)  # (S, Lq, Lk)
    mask[:, :, lp:] &= slot[None, :] <= slot[:, None]  # own keys up to the query (slot 0 is always there)
    return AttentionBlock(q_index, q_valid, kv_index, mask[:, None], q_index[q_valid])


def attention_blocks(segments: torch.Tensor, sees: torch.Tensor) -> list[AttentionBlock]:
    """The segment-by-segment attention of a packed micro-batch (see `packed_sdpa_attention`): one block
    of the segments that see a prompt segment, one of those that see only themselves."""
    device = segments.device
    seg, see = segments.reshape(-1).cpu(), sees.reshape(-1).cpu()
    order = torch.argsort(seg, stable=True)  # flattened positions by segment, in position order
    ids, counts = torch.unique_consecutive(seg[order], return_counts=True)
    tokens = {s: t for s, t in zip(ids.tolist(), torch.split(order, counts.tolist())) if s >= 0}
    alone, seeing, prompts = [], [], []
    for s, toks in tokens.items():
        prompt = int(see[toks[0]])
        if prompt < 0 or prompt == s:
            alone.append(toks)
        else:
            seeing.append(toks)
            prompts.append(tokens[prompt])
    blocks = []
    if alone:
        blocks.append(_attention_block(alone, None))
    if seeing:
        blocks.append(_attention_block(seeing, prompts))
    return [b.to(device) for b in blocks]


def packed_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          sliding_window: int | None = None, attention_blocks=None, **kwargs):
    """HF attention interface, (batch, heads, L, d) q/k/v in and (batch, L, heads, d) out: with
    `attention_blocks` (a list of AttentionBlock) each block is one SDPA call over its segments' gathered
    queries and keys, and positions in no segment (padding) get 0; without, SDPA with the mask.

    Grouped-query models on CPU hand SDPA their kv heads as they are (`enable_gqa`: its CPU kernel takes
    them with a mask), so backward keeps k and v at kv-head width; elsewhere they are repeated, as HF's
    SDPA does with a mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_blocks is not None and sliding_window is not None:
        raise ValueError("attention_blocks carry no sliding window; pack this model with its dense mask")
    b, heads, length, _ = query.shape
    kv_heads = key.shape[1]
    gqa = kv_heads != heads and query.device.type == "cpu"
    if attention_blocks is None:
        if not gqa or attention_mask is None or kwargs.get("position_bias") is not None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, sliding_window=sliding_window, **kwargs)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    q = query.transpose(1, 2).reshape(b * length, heads, query.shape[-1])
    k = key.transpose(1, 2).reshape(b * length, kv_heads, key.shape[-1])
    v = value.transpose(1, 2).reshape(b * length, kv_heads, value.shape[-1])
    outs, index = [], []
    for block in attention_blocks:
        qs = q[block.q_index].transpose(1, 2)  # (S, heads, Lq, d)
        ks, vs = k[block.kv_index].transpose(1, 2), v[block.kv_index].transpose(1, 2)  # (S, kv_heads, Lk, d)
        if kv_heads != heads and not gqa:
            ks, vs = ks.repeat_interleave(heads // kv_heads, 1), vs.repeat_interleave(heads // kv_heads, 1)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=block.mask, dropout_p=dropout, scale=scaling,
                                             enable_gqa=gqa)
        outs.append(out.transpose(1, 2)[block.q_valid])  # (valid slots, heads, d)
        index.append(block.out_index)
    out = query.new_zeros(b * length, heads, value.shape[-1]).index_copy(0, torch.cat(index), torch.cat(outs))
    return out.view(b, length, heads, value.shape[-1]), None


def register_packed_attention() -> str:
    """Register "tinyzero_packed_sdpa" with HF's attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, sdpa_mask)
    return PACKED_ATTENTION


@dataclass
class Packed:
    """Packed model inputs and where each response token's prediction sits."""

    input_ids: torch.Tensor  # (rows, L)
    position_ids: torch.Tensor  # (rows, L)
    segments: torch.Tensor  # (rows, L) segment of each token, -1 = padding
    sees: torch.Tensor  # (rows, L) the prompt segment a token may also attend to
    hidden_index: torch.Tensor  # (valid response tokens,) into the flattened (rows * L) positions
    valid: torch.Tensor  # (batch, R) bool, the response tokens that exist (row-major order of hidden_index)
    blocks: list | None = None  # AttentionBlocks for packed_sdpa_attention (set by model_mask)

    def mask_mod(self):
        """The attention rule as a flex_attention mask_mod(b, h, q, kv) -> bool.

        A token sees the earlier tokens of its own segment and of the prompt segment it may see;
        padding sees itself only (no empty softmax row).
        """
        seg, sees = self.segments, self.sees

        def mask_mod(b, h, q, kv):
            k_seg = seg[b, kv]
            visible = (seg[b, q] == k_seg) | (sees[b, q] == k_seg)
            return (visible & (k_seg >= 0) & (kv <= q)) | (q == kv)

        return mask_mod

    def dense_mask(self) -> torch.Tensor:
        """(rows, 1, L, L) bool, True = may attend: the rule of `mask_mod`, materialised."""
        length = self.segments.shape[1]
        pos = torch.arange(length, device=self.segments.device)
        key_seg = self.segments[:, None, :]  # (rows, 1, L)
        visible = (self.segments[:, :, None] == key_seg) | (self.sees[:, :, None] == key_seg)
        causal = pos[None, :] <= pos[:, None]  # (L, L): key <= query
        mask = (visible & (key_seg >= 0) & causal) | (pos[None, :] == pos[:, None])
        return mask[:, None]

    def block_mask(self):
        """A flex_attention BlockMask of the same rule (block-sparse; nothing L x L is stored)."""
        from torch.nn.attention.flex_attention import create_block_mask

        rows, length = self.segments.shape
        return create_block_mask(self.mask_mod(), B=rows, H=None, Q_LEN=length, KV_LEN=length,
                                 device=self.segments.device)

    def keep_only(self, wanted: torch.Tensor) -> None:
        """Narrow the predicted response tokens to `wanted` (batch, R) bool (e.g. SFT's targets): the others'
        hidden states are not gathered, and their results scatter to 0."""
        self.hidden_index = self.hidden_index[wanted[self.valid]]
        self.valid = self.valid & wanted

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """(valid tokens,) results -> (batch, R), 0 at padding; differentiable."""
        out = flat.new_zeros(self.valid.shape)
        out[self.valid] = flat
        return out


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  response_length: int) -> list[list[int]]:
    """Rows with identical prompts (valid tokens and positions), groups in first-appearance order."""
    p = input_ids.shape[1] - response_length
    am = attention_mask[:, :p].bool().cpu()
    ids, pos = input_ids[:, :p].cpu(), position_ids[:, :p].cpu()
    groups: dict[bytes, list[int]] = {}
    for i in range(len(ids)):
        key = ids[i][am[i]].numpy().tobytes() + b"|" + pos[i][am[i]].numpy().tobytes()
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def unit_token_counts(attention_mask: torch.Tensor, response_length: int, units: list[list[int]]) -> list[int]:
    """Tokens a unit (prompt once + its rows' responses) occupies when packed."""
    p = attention_mask.shape[1] - response_length
    prompt = attention_mask[:, :p].sum(-1).tolist()
    resp = attention_mask[:, p:].sum(-1).tolist()
    return [int(prompt[u[0]] + sum(resp[i] for i in u)) for u in units]


def _split_long_units(units: list[list[int]], prompt_lens: list[int], resp_lens: list[int],
                      max_tokens: int) -> list[list[int]]:
    """Cut groups longer than `max_tokens` packed tokens into runs of rows that fit (prompt repeated)."""
    out = []
    for unit in units:
        run, size = [], prompt_lens[unit[0]]
        for i in unit:
            if run and size + resp_lens[i] > max_tokens:
                out.append(run)
                run, size = [], prompt_lens[unit[0]]
            run.append(i)
            size += resp_lens[i]
        out.append(run)
    return out


def _first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for u in sorted(range(len(sizes)), key=lambda u: (-sizes[u], u)):
        for b, free in enumerate(room):
            if sizes[u] <= free:
                bins[b].append(u)
                room[b] -= sizes[u]
                break
        else:
            bins.append([u])
            room.append(capacity - sizes[u])
    return bins


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
         response_length: int, share_prefix: bool, max_unit_tokens: int | None = None) -> Packed:
    """Pack a (batch, P + R) micro-batch; see the module docstring for the layout.

    `max_unit_tokens` cuts longer groups into several units (None: groups stay whole).
    """
    if position_ids.dim() != 2:
        raise ValueError("packed training supports (batch, seq) position_ids only; set use_remove_padding=False "
                         "and use_shared_prefix=False for models with multi-section (mrope) positions")
    device = input_ids.device
    b, total = input_ids.shape
    r = response_length
    p = total - r
    ids_c, pos_c, am = input_ids.cpu(), position_ids.cpu(), attention_mask.bool().cpu()
    prompt_lens = am[:, :p].sum(-1)
    if bool((prompt_lens == 0).any()):
        raise ValueError(f"row {int((prompt_lens == 0).nonzero()[0])} has an empty prompt; packed training needs "
                         f"at least one prompt token per row (turn use_remove_padding / use_shared_prefix off)")
    units = (prompt_groups(ids_c, am, pos_c, r) if share_prefix else [[i] for i in range(b)])
    if share_prefix and max_unit_tokens is not None:
        units = _split_long_units(units, prompt_lens.tolist(), am[:, p:].sum(-1).tolist(), max_unit_tokens)
    sizes = unit_token_counts(am.long(), r, units)
    bins = _first_fit_decreasing(sizes, max(sizes))
    length = max(sum(sizes[u] for u in bin_) for bin_ in bins)
    rows = len(bins)
    ids = torch.zeros(rows, length, dtype=input_ids.dtype)
    pos = torch.zeros(rows, length, dtype=position_ids.dtype)
    seg = torch.full((rows, length), -1, dtype=torch.long)  # segment of each token, -1 = padding
    sees = torch.full((rows, length), -1, dtype=torch.long)  # the prompt segment a token may also see
    index = torch.zeros(b, r, dtype=torch.long)
    next_seg = 0
    for row, bin_ in enumerate(bins):
        off = 0
        for u in bin_:
            first = units[u][0]
            cols = am[first, :p].nonzero().squeeze(-1)
            n = len(cols)
            ids[row, off:off + n], pos[row, off:off + n] = ids_c[first, cols], pos_c[first, cols]
            prompt_seg, next_seg = next_seg, next_seg + 1
            seg[row, off:off + n] = prompt_seg
            sees[row, off:off + n] = prompt_seg
            last_prompt = row * length + off + n - 1
            off += n
            for i in units[u]:
                rcols = am[i, p:].nonzero().squeeze(-1)
                k = len(rcols)
                if k == 0:
                    continue
                ids[row, off:off + k], pos[row, off:off + k] = ids_c[i, p + rcols], pos_c[i, p + rcols]
                seg[row, off:off + k] = next_seg
                sees[row, off:off + k] = prompt_seg
                next_seg += 1
                pred = torch.arange(k) + (row * length + off - 1)
                pred[0] = last_prompt
                index[i, rcols] = pred
                off += k
    valid = am[:, p:]
    return Packed(input_ids=ids.to(device), position_ids=pos.to(device), segments=seg.to(device),
                  sees=sees.to(device), hidden_index=index[valid].to(device), valid=valid.to(device))


def model_mask(packed: Packed, model: nn.Module, dtype: torch.dtype):
    """The 4-D mask in the form the model's attention takes: BlockMask for flex_attention, additive
    float for eager, bool for SDPA; for packed_sdpa_attention the segment blocks (on `packed`)."""
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == "flex_attention":
        return packed.block_mask()
    if uses_attention_blocks(model):
        blocks = attention_blocks(packed.segments, packed.sees)
        rows, length = packed.segments.shape
        if sum(b.mask.numel() for b in blocks) <= BLOCKS_WORTH * rows * length * length:
            # The attention takes packed.blocks; the mask it is also handed is a free all-True view.
            packed.blocks = blocks
            return torch.ones((), dtype=torch.bool, device=packed.segments.device).expand(rows, 1, length, length)
    mask = packed.dense_mask()
    if impl == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask
