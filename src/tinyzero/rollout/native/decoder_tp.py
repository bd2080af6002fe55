"""Tensor-parallel decoding for the fused decoder (rollout.tensor_model_parallel_size > 1).

The ranks of the engine's tensor-parallel group decode one batch together, every rank holding the
whole batch: each attends for its 1/T of the prompts' rows (their KV cache only) and computes a 1/T
column block of every MLP and of lm_head for all rows. The attention rows are all-gathered and the
MLP's partial sums all-reduced once per layer, the logits' vocabulary blocks gathered once per step,
through the group's `tp_comm` (shared memory on one CPU host). A decode step then reads 1/T of the MLP
and lm_head weights for T times the rows: decode is bound by reading the weights at small batches.
The residual stream, the logits and so the samples are the same on every rank.

`TensorParallelDecoding` is the part of `decoder.FusedDecoder` that does this; FusedDecoder's reset,
begin and prefill pick this rank's prompts when a batch decodes tensor-parallel (`tp_on`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyzero.rollout.native.fused_ops import wide_mm


class TensorParallelDecoding:
    """FusedDecoder's tensor-parallel shards and decode step (a mixin: it reads the decoder's layers,
    fused weight views and caches)."""

    def _fuse_tensor_parallel(self) -> None:
        """This rank's shards as views of the full weights: columns rank*I/T .. of gate and up (rows of
        their weights), the same rows of down's (in, out) view, and a 1/T block of lm_head's vocabulary
        (the last one shorter when T does not divide it)."""
        T, r = self.comm.size, self.comm.rank
        self.tp_lm_head_wt = None
        for layer, f in zip(self.layers, self.fused):
            m = layer.mlp
            inter = m.gate_proj.weight.shape[0]
            if inter % T or f["down_wt"] is None or f["gate_up_lora"] is not None:
                return
            n = inter // T
            gu = f["gate_up_w"].view(2, T, n, -1)  # [gate | up] rows, each in T blocks
            f["tp_gate_wt"], f["tp_up_wt"] = gu[0, r].t(), gu[1, r].t()
            f["tp_down_wt"] = f["down_wt"][r * n:(r + 1) * n]
        if self.lm_head_wt is None:
            return
        vocab = self.lm_head.weight.shape[0]
        per = -(-vocab // T)
        self.tp_vocab = (vocab, per)
        self.tp_lm_head_wt = self.lm_head.weight[r * per:(r + 1) * per].t()

    def set_tensor_parallel(self, comm) -> None:
        """Decode over a tensor-parallel group (rollout.tensor_model_parallel_size), every rank holding the
        whole batch: each attends for its 1/T of the prompts' rows (their KV cache only) and computes a
        1/T column block of every MLP and of lm_head for all rows; the attention rows are all-gathered and
        the MLP's partial sums all-reduced once per layer, the logits' vocabulary blocks gathered once per
        step. A decode step then reads 1/T of the MLP and lm_head weights for T times the rows (decode is
        bound by reading the weights at small batches). The residual stream, the logits and so the samples
        are the same on every rank. A batch whose prompts do not split evenly, unmerged LoRA adapters or an
        intermediate size T does not divide decode on every rank alone (the same tokens, T times the work)."""
        if self._compiled is not None:
            raise ValueError("rollout.native_compile does not combine with rollout.tensor_model_parallel_size > 1")
        self.comm = comm
        self._fuse()

    def _tp_ready(self) -> bool:
        return self.comm is not None and self.comm.size > 1 and self.tp_lm_head_wt is not None \
            and all("tp_down_wt" in f for f in self.fused)

    def decode_step_tp(self, token: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor,
                       kv: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor | None = None,
                       group_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                       active: torch.Tensor | None = None) -> torch.Tensor:
        """`decode_step` over the tensor-parallel group (set_tensor_parallel): token, cos, sin and `active`
        cover every row of the batch; bias, kv and group_kv this rank's rows [lo, hi). The residual stream
        x holds every (active) row on every rank."""
        comm, (lo, hi) = self.comm, self.tp_rows
        if active is None:
            x = F.embedding(token, self.embed.weight)  # (B, hidden)
            cos, sin, own, local = cos[lo:hi], sin[lo:hi], None, None
        else:
            x = F.embedding(token[active], self.embed.weight)  # (A, hidden)
            mine = (active >= lo) & (active < hi)
            own = mine.nonzero().squeeze(1)  # this rank's rows among the active ones
            local = active[own] - lo  # ... as indices into its own rows
            cos, sin = cos[active[own]], sin[active[own]]
        for i, (f, layer_kv) in enumerate(zip(self.fused, kv)):
            h = f["input_norm"](x)
            h = h[lo:hi] if own is None else h[own]
            if group_kv is None:
                a = self._attention_decode(f, h, cos, sin, bias, layer_kv, local)
            else:
                a = self._attention_decode_shared(f, h, cos, sin, bias, slots, layer_kv, group_kv[i], local)
            if own is not None:  # the same shape on every rank: this rank's rows, zero where stopped
                a = a.new_zeros((hi - lo, a.shape[1])).index_copy_(0, local, a)
            a = comm.all_gather(a).view(-1, a.shape[1])  # (B, hidden)
            x.add_(a if active is None else a[active])
            h = f["post_norm"](x)
            y = torch.mm(f["act"](torch.mm(h, f["tp_gate_wt"])).mul_(torch.mm(h, f["tp_up_wt"])), f["tp_down_wt"])
            x.add_(comm.all_reduce_(y))
        logits = wide_mm(self.final_norm(x), self.tp_lm_head_wt)  # (rows, this rank's vocabulary block)
        vocab, per = self.tp_vocab
        if logits.shape[1] < per:
            logits = F.pad(logits, (0, per - logits.shape[1]))
        parts = comm.all_gather(logits)  # (T, rows, per)
        return parts.permute(1, 0, 2).reshape(x.shape[0], -1)[:, :vocab].float()
