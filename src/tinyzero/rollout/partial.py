"""Partial rollouts: a generation that takes new weights between segments and goes on under them.

With `pipeline.partial_rollout` the asynchronous pipeline (tinyzero.trainer.async_pipeline) wraps
the rollout pool's engine in `PartialRollout`. A training generation during which the trainer pool
publishes weight version v (the batch's meta_info["partial_rollout_version"] = v) decodes in
segments of `chunk` new tokens. At every segment boundary it asks its `WeightSource` whether v has
arrived; if so it loads v into the engine and continues the unfinished rows under it. A segment
continues a row by re-prefilling prompt + response so far as the next prompt (n=1), so any engine
that generates from a left-padded prompt batch can continue. Versions only move forward, so each
row's tokens hold at most two versions per update.

Every response token records the version that sampled it (`rollout_token_versions`, (rows, R)
int64, -1 on padding) and keeps the rollout log-prob the sampling policy gave it when it was
sampled: the off-policy corrections that read `rollout_log_probs` (TIS, masked IS) stay exact per
token. Generations without that meta key (validation, generations with no update running) go to
the engine in one piece and carry the engine's version on every token.

    engine = PartialRollout(NativeRollout(...), chunk=32, source=BridgeSource(bridge_ranks, device))
    out = engine.generate_sequences(prompts)   # meta_info: rollout_weight_version, partial_rollout_version
"""

from __future__ import annotations

from typing import Iterator, Protocol

import torch

from tinyzero.protocol import DataProto
from tinyzero.rollout.engine import resolve_sampling_params
from tinyzero.rollout.generate import stop_hits
from tinyzero.rollout.outputs import PROMPT_KEYS, build_output, pad_responses
from tinyzero.rollout.weight_bridge import checksum, tensor_sum

__all__ = ["WeightSource", "PartialRollout"]

_SEGMENT_SEED = 15_485_867  # mixed into the batch's seed per segment: segments draw fresh noise


class WeightSource(Protocol):
    """Where a partial rollout takes new weights from (weight_bridge.BridgeSource across pools)."""

    def arrived(self, version: int) -> bool:
        """Whether `version` is being sent (never blocks)."""

    def receive(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs of `version`; blocks (bounded) until they come."""


class PartialRollout:
    """An engine wrapper that applies new weights between decoding segments (see module docstring).
    Everything but generate_sequences is the wrapped engine's."""

    def __init__(self, engine, chunk: int, source: WeightSource):
        if chunk < 1:
            raise ValueError(f"PartialRollout: chunk={chunk} must be >= 1 (pipeline.partial_rollout_chunk)")
        self.engine, self.chunk, self.source = engine, chunk, source
        self.held_version: int | None = None  # the newest version loaded by take_weights
        self.held_checksum = 0.0               # float64 checksum of the engine's copy of it

    def __getattr__(self, name):
        if name == "engine":  # not set yet (e.g. while copying): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    def take_weights(self, version: int, awake: bool = False) -> float:
        """Load `version` from the source unless already held; returns the engine copy's checksum.
        Outside a generation (awake False) the engine's weights are woken for it and put back to sleep."""
        if self.held_version != version:
            if not awake:
                self.engine.wake_up(tags=["weights"])
            names, sent = [], [0.0]

            def stream():  # bucket by bucket, as the source receives them
                for name, tensor in self.source.receive(version):
                    names.append(name)
                    sent[0] += tensor_sum(tensor)
                    yield name, tensor

            try:
                self.engine.update_weights(stream())
            finally:
                if not awake:
                    self.engine.sleep()
            model = getattr(self.engine, "model", None)
            held = model.state_dict() if hasattr(model, "state_dict") else {}
            self.held_checksum = checksum((n, held[n]) for n in names) if names and all(
                n in held for n in names) else sent[0]
            self.held_version = version
        return self.held_checksum

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        meta = dict(prompts.meta_info)
        incoming = meta.pop("partial_rollout_version", None)
        version = int(meta.pop("rollout_weight_version", 0) or 0)
        if incoming is not None and self.held_version == int(incoming):
            incoming, version = None, int(incoming)  # an earlier generation already took it
        if incoming is None:
            prompts.meta_info = meta
            out = self.engine.generate_sequences(prompts)
            mask = out.batch["response_mask"]
            out.batch["rollout_token_versions"] = torch.where(mask.bool(), version, -1).long()
            return out
        return self._segmented(prompts, meta, version, int(incoming))

    def _segmented(self, prompts: DataProto, meta: dict, version: int, incoming: int) -> DataProto:
        params = resolve_sampling_params(self.engine.config, meta, seed=0)
        R = params.response_length
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long)
        first = self._segment(prompts.batch, {**meta, "response_length": min(self.chunk, R)})
        P = first.batch["prompts"].shape[1]
        heads = tuple(first.batch[k][:, :P] for k in PROMPT_KEYS)  # (rows, P) each
        rows = heads[0].shape[0]
        tokens, log_probs, versions = [[] for _ in range(rows)], [[] for _ in range(rows)], [[] for _ in range(rows)]
        live = list(range(rows))
        out, segment = first, 0
        while True:
            mask = out.batch["response_mask"].bool()  # (live, seg_len)
            seg_len = mask.shape[1]
            still = []
            for j, i in enumerate(live):
                kept = int(mask[j].sum())
                tokens[i] += out.batch["responses"][j, :kept].tolist()
                log_probs[i] += out.batch["rollout_log_probs"][j, :kept].tolist()
                versions[i] += [version] * kept
                done = kept < seg_len or len(tokens[i]) >= R or bool(
                    stop_hits(torch.tensor([tokens[i]]), stop_ids, params.stop_sequences).any())
                if not done:
                    still.append(i)
            live = still
            if version != incoming and self.source.arrived(incoming):
                self.take_weights(incoming, awake=True)
                version = incoming
            if not live:
                break
            segment += 1
            step_meta = {**meta, "n": 1, "response_length": min(self.chunk, R - len(tokens[live[0]]))}
            if "seed" in meta:
                step_meta["seed"] = int(meta["seed"]) + _SEGMENT_SEED * segment
            out = self._segment(self._continuation(heads, tokens, live, params.pad_token_id), step_meta)
        responses, response_mask, lps = pad_responses(tokens, log_probs, R, params.pad_token_id,
                                                      params.stop_token_ids, params.stop_sequences)
        token_versions = torch.full((rows, R), -1, dtype=torch.long)
        for i in range(rows):
            token_versions[i, :len(versions[i])] = torch.tensor(versions[i], dtype=torch.long)
        token_versions = torch.where(response_mask.bool(), token_versions, -1)
        result = build_output(*heads, responses, response_mask, lps, meta_info=first.meta_info)
        result.batch["rollout_token_versions"] = token_versions
        return result

    def _segment(self, batch, meta: dict) -> DataProto:
        return self.engine.generate_sequences(DataProto.from_dict(
            tensors={k: batch[k] for k in PROMPT_KEYS}, meta_info=meta))

    @staticmethod
    def _continuation(heads, tokens: list[list[int]], live: list[int], pad_id: int) -> dict:
        """Left-padded prompt + response-so-far of the `live` rows (every live row has as many tokens)."""
        ids, mask, _ = heads
        made = torch.tensor([tokens[i] for i in live], dtype=torch.long)  # (live, done)
        new_ids = torch.cat([ids[live], made], dim=1)
        new_mask = torch.cat([mask[live], torch.ones_like(made)], dim=1)
        new_ids = torch.where(new_mask.bool(), new_ids, pad_id)
        return {"input_ids": new_ids, "attention_mask": new_mask,
                "position_ids": torch.clamp(torch.cumsum(new_mask, dim=-1) - 1, min=0)}
