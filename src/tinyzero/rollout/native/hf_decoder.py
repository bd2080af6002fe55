"""The native engine's decoder for any HF causal LM: the model itself with its own DynamicCache."""

from __future__ import annotations

import torch
from torch import nn


class HFDecoder:
    """Drives the HF model itself with a DynamicCache: slower, but runs any causal LM. With prefix sharing
    (group_size > 1) the prompts are prefilled once and the cache is expanded by index to their rows
    before the first decode step (saves the prefill; the decode steps read a per-row copy)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache = None
        self.group_size = 1
        self._expanded = True

    def reset(self, num_prompts: int, prompt_len: int, response_len: int, group_size: int = 1,
              shared_kv: bool = False) -> None:
        """A fresh cache; group_size > 1 expands it by index after the prefill (shared_kv is ignored)."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.group_size = group_size
        self._expanded = group_size == 1

    def release(self) -> None:
        self.cache = None

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, key_valid: torch.Tensor,
                 start: int) -> torch.Tensor:
        if start > 0 and not self._expanded:  # first decode step: prompt i's cache -> rows i*g .. i*g+g-1
            self.cache.batch_repeat_interleave(self.group_size)
            self._expanded = True
        out = self.model(input_ids=input_ids, attention_mask=key_valid.long(), position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[:, -1].float()
