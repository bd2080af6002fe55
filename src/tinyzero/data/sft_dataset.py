"""SFT and pairwise (reward-model / DPO) datasets from parquet, right-padded to data.max_length.

SFTDataset items: input_ids, attention_mask, position_ids, loss_mask, each (max_length,).
`loss_mask[t] == 1` exactly where token t is a target the model must learn to produce (the
response, or every assistant turn, including its end-of-turn token); a trainer computes the
loss of predicting input_ids[:, 1:] from logits[:, :-1] weighted by loss_mask[:, 1:].

Rows are either single-turn, `prompt` (a string or chat messages) + `response` (a string),
or multi-turn, `messages` (set data.messages_key): a chat whose assistant turns are all
trained on. Multi-turn rows need the chat template; each assistant turn's tokens are found
by rendering the conversation up to that turn and checking the rendering is a token prefix
of the full conversation (true of ChatML-style templates; anything else is a clear error).

PairwiseDataset items: chosen_* and rejected_* versions of input_ids, attention_mask,
position_ids and loss_mask for `prompt`, `chosen`, `rejected` rows.
"""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import torch

from tinyzero.data.config import DataConfig
from tinyzero.data.rl_dataset import compute_position_ids, pad_token_id_of, render_prompt
from tinyzero.data.schema import open_parquet

__all__ = ["SFTDataset", "PairwiseDataset", "right_pad"]


def right_pad(ids: list[int], mask: list[int], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / position_ids / loss_mask of shape (length,), padding on the right."""
    n = len(ids)
    input_ids = torch.full((length,), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(length, dtype=torch.long)
    loss_mask = torch.zeros(length, dtype=torch.long)
    input_ids[:n] = torch.tensor(ids, dtype=torch.long)
    attention_mask[:n] = 1
    loss_mask[:n] = torch.tensor(mask, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": compute_position_ids(attention_mask), "loss_mask": loss_mask}


def _read_rows(files: list[str], columns: list[str]) -> list[tuple[str, int, dict]]:
    out = []
    for path in files:
        names = open_parquet(path).schema_arrow.names  # names a missing, empty or non-parquet file
        missing = [c for c in columns if c not in names]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing} (found {names})")
        for i, row in enumerate(pq.read_table(path, columns=columns).to_pylist()):
            out.append((path, i, row))
    return out


def _as_messages(prompt, where: str) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                   for m in prompt):
        return prompt
    raise ValueError(f"{where}: prompt must be a string or a non-empty list of {{'role', 'content'}} messages")


class _TokenizedDataset:
    """Shared plumbing: tokenizer, truncation to max_length, eos handling."""

    def __init__(self, data_files, tokenizer, config: DataConfig | None):
        self.config = config if config is not None else DataConfig()
        files = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
        self.files = [os.fspath(f) for f in files]
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id_of(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self.num_filtered = 0

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        return self._encode(render_prompt(messages, self.tokenizer, self.config.apply_chat_template))

    def _response_ids(self, text: str) -> list[int]:
        ids = self._encode(text)
        if self.eos_token_id is not None:
            ids.append(int(self.eos_token_id))
        return ids

    def _fit(self, ids: list[int], mask: list[int], where: str) -> tuple[list[int], list[int]] | None:
        limit = self.config.max_length
        if len(ids) <= limit:
            return ids, mask
        mode = self.config.truncation
        if mode == "left":
            return ids[-limit:], mask[-limit:]
        if mode == "right":
            return ids[:limit], mask[:limit]
        if mode == "filter":
            return None
        raise ValueError(f"{where}: {len(ids)} tokens, more than data.max_length={limit}; raise it or set "
                         "data.truncation to left, right or filter")


class SFTDataset(_TokenizedDataset):
    """Supervised fine-tuning examples (see the module docstring)."""

    def __init__(self, data_files, tokenizer, config: DataConfig | None = None):
        super().__init__(data_files, tokenizer, config)
        cfg = self.config
        multi = cfg.messages_key is not None
        if multi and not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn SFT (data.messages_key) needs a tokenizer with a chat template")
        columns = [cfg.messages_key] if multi else [cfg.prompt_key, cfg.response_key]
        self.examples: list[tuple[list[int], list[int]]] = []
        for path, i, row in _read_rows(self.files, columns):
            where = f"{path}: row {i}"
            ids, mask = self._multi_turn(row[cfg.messages_key], where) if multi else self._single_turn(row, where)
            fitted = self._fit(ids, mask, where)
            if fitted is None:
                self.num_filtered += 1
                continue
            self.examples.append(fitted)
        if not self.examples:
            raise ValueError(f"no usable SFT examples in {self.files}")

    def _single_turn(self, row: dict, where: str) -> tuple[list[int], list[int]]:
        messages = _as_messages(row[self.config.prompt_key], f"{where}: {self.config.prompt_key}")
        response = row[self.config.response_key]
        if not isinstance(response, str):
            raise ValueError(f"{where}: {self.config.response_key}: expected a string, got {type(response).__name__}")
        prompt_ids = self._prompt_ids(messages)
        response_ids = self._response_ids(response)
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)

    def _multi_turn(self, messages, where: str) -> tuple[list[int], list[int]]:
        messages = _as_messages(messages, f"{where}: {self.config.messages_key}")
        if not any(m.get("role") == "assistant" for m in messages):
            raise ValueError(f"{where}: {self.config.messages_key}: no assistant turn to train on")
        tok = self.tokenizer
        full = self._encode(tok.apply_chat_template(messages, tokenize=False))
        mask = [0] * len(full)
        for k, msg in enumerate(messages):
            if msg.get("role") != "assistant":
                continue
            before = self._encode(tok.apply_chat_template(messages[:k], tokenize=False,
                                                          add_generation_prompt=True)) if k else []
            through = self._encode(tok.apply_chat_template(messages[:k + 1], tokenize=False))
            if full[:len(through)] != through or through[:len(before)] != before:
                raise ValueError(f"{where}: the chat template does not render turn {k} as a prefix of the "
                                 "conversation; multi-turn loss masks need a prefix-stable template")
            for t in range(len(before), len(through)):
                mask[t] = 1
        return full, mask

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        ids, mask = self.examples[index]
        return right_pad(ids, mask, self.config.max_length, self.pad_token_id)


class PairwiseDataset(_TokenizedDataset):
    """(prompt, chosen, rejected) preference pairs for reward-model or DPO training."""

    def __init__(self, data_files, tokenizer, config: DataConfig | None = None):
        super().__init__(data_files, tokenizer, config)
        cfg = self.config
        self.pairs: list[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]] = []
        for path, i, row in _read_rows(self.files, [cfg.prompt_key, cfg.chosen_key, cfg.rejected_key]):
            where = f"{path}: row {i}"
            prompt_ids = self._prompt_ids(_as_messages(row[cfg.prompt_key], f"{where}: {cfg.prompt_key}"))
            sides = []
            for key in (cfg.chosen_key, cfg.rejected_key):
                if not isinstance(row[key], str):
                    raise ValueError(f"{where}: {key}: expected a string, got {type(row[key]).__name__}")
                response_ids = self._response_ids(row[key])
                sides.append(self._fit(prompt_ids + response_ids,
                                       [0] * len(prompt_ids) + [1] * len(response_ids), f"{where} ({key})"))
            if sides[0] is None or sides[1] is None:
                self.num_filtered += 1
                continue
            self.pairs.append((sides[0], sides[1]))
        if not self.pairs:
            raise ValueError(f"no usable preference pairs in {self.files}")

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict:
        item = {}
        for name, (ids, mask) in zip(("chosen", "rejected"), self.pairs[index]):
            for key, value in right_pad(ids, mask, self.config.max_length, self.pad_token_id).items():
                item[f"{name}_{key}"] = value
        return item
