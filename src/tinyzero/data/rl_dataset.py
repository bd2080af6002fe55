"""RLHFDataset: RL prompts from parquet, tokenized and left-padded for generation.

    ds = RLHFDataset(["train.parquet"], tokenizer, DataConfig(max_prompt_length=256))
    item = ds[0]   # input_ids / attention_mask / position_ids (max_prompt_length,) tensors,
                   # raw_prompt_ids (list[int], no padding), data_source, reward_model, extra_info,
                   # ability, index, and any extra columns of the row

Every file is validated row by row when the dataset is built (errors name file, row and
field), and so are prompt lengths under truncation "error" or "filter". Rows stay in arrow
tables and are converted to Python only when fetched, so a 327k-row countdown set costs
little memory per rank. Prompts are rendered with the tokenizer's chat template
(`apply_chat_template=True`, generation prompt appended) or used raw (the message contents
joined by newlines), then tokenized without special tokens.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import torch

from tinyzero.data.config import DataConfig
from tinyzero.data.schema import load_rl_parquet
from tinyzero.distributed import get_rank

__all__ = ["RLHFDataset", "render_prompt", "left_pad", "compute_position_ids", "pad_token_id_of"]

_TOKENIZE_BATCH = 4096


def render_prompt(messages: list[dict], tokenizer, apply_chat_template: bool) -> str:
    """The prompt text: the chat template with a generation prompt, or the raw contents."""
    if apply_chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages)


def pad_token_id_of(tokenizer) -> int:
    """The tokenizer's pad id, falling back to eos; ValueError if it has neither."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    raise ValueError("the tokenizer has neither a pad token nor an eos token; set one in its config")


def left_pad(ids: list[int], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of shape (length,), ids right-aligned after pad tokens."""
    n = len(ids)
    if n > length:
        raise ValueError(f"left_pad: {n} ids do not fit in {length}")
    input_ids = torch.full((length,), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(length, dtype=torch.long)
    if n:
        input_ids[length - n:] = torch.tensor(ids, dtype=torch.long)
        attention_mask[length - n:] = 1
    return input_ids, attention_mask


def compute_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting valid tokens only: 0 on left padding, then 0, 1, 2, ..."""
    return torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)


class RLHFDataset:
    """Prompts of one or more RL parquet files (see the module docstring)."""

    def __init__(self, data_files: str | list[str], tokenizer, config: DataConfig | None = None):
        self.config = config if config is not None else DataConfig()
        self.files = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
        self.files = [os.fspath(f) for f in self.files]
        if not self.files:
            raise ValueError("RLHFDataset needs at least one parquet file (data.train_files / data.val_files)")
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id_of(tokenizer)
        if self.config.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "data.apply_chat_template is True but the tokenizer has no chat template; set "
                "data.apply_chat_template=False for base models or pre-rendered prompts"
            )
        self.tables = [load_rl_parquet(f, self.config.prompt_key) for f in self.files]
        sizes = [t.num_rows for t in self.tables]
        for path, n in zip(self.files, sizes):
            if n == 0:
                raise ValueError(f"data file {path!r} has no rows (a parquet file with its columns and 0 rows); "
                                 "write it again, or leave it out of data.train_files / data.val_files")
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_rows_total = int(self._offsets[-1])
        self.data_sources = sorted({s for t in self.tables for s in t.column("data_source").unique().to_pylist()})
        self._keep = np.arange(self.num_rows_total, dtype=np.int64)
        self.num_filtered = 0
        if self.config.truncation == "filter":
            self._filter_overlong(self._prompt_lengths())
        elif self.config.truncation == "error":  # at load, not steps into a run when the row is drawn
            self._check_lengths(self._prompt_lengths())

    # ------------------------------------------------------------------ loading
    def _locate(self, global_row: int) -> tuple[int, int]:
        file_idx = int(np.searchsorted(self._offsets, global_row, side="right") - 1)
        return file_idx, int(global_row - self._offsets[file_idx])

    def _prompt_lengths(self) -> np.ndarray:
        lengths = np.zeros(self.num_rows_total, dtype=np.int64)
        pos = 0
        for path in self.files:
            pf = pq.ParquetFile(path)
            for batch in pf.iter_batches(batch_size=_TOKENIZE_BATCH, columns=[self.config.prompt_key]):
                texts = [render_prompt(m, self.tokenizer, self.config.apply_chat_template)
                         for m in batch.column(0).to_pylist()]
                ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
                lengths[pos:pos + len(ids)] = [len(x) for x in ids]
                pos += len(ids)
        return lengths

    def _check_lengths(self, lengths: np.ndarray) -> None:
        limit = self.config.max_prompt_length
        over = np.nonzero(lengths > limit)[0]
        if not len(over):
            return
        f, local = self._locate(int(over[0]))
        longest = int(lengths.max())
        raise ValueError(
            f"{self.files[f]}: row {local}: prompt has {int(lengths[over[0]])} tokens, more than "
            f"data.max_prompt_length={limit} ({len(over)} of {self.num_rows_total} prompts are; the longest has "
            f"{longest}); set data.max_prompt_length={longest} or data.truncation to left, right or filter"
        )

    def _filter_overlong(self, lengths: np.ndarray) -> None:
        keep = lengths <= self.config.max_prompt_length
        self._keep = np.nonzero(keep)[0].astype(np.int64)
        self.num_filtered = int((~keep).sum())
        if get_rank() == 0:
            print(f"[data] filtered {self.num_filtered} of {self.num_rows_total} prompts longer than "
                  f"max_prompt_length={self.config.max_prompt_length} ({', '.join(self.files)})", flush=True)
        if not len(self._keep):
            raise ValueError(f"every prompt in {self.files} is longer than data.max_prompt_length="
                             f"{self.config.max_prompt_length}; raise it")

    def _fetch_rows(self, global_rows: list[int]) -> list[dict]:
        out: list[dict | None] = [None] * len(global_rows)
        by_file: dict[int, list[tuple[int, int]]] = {}
        for pos, g in enumerate(global_rows):
            f, local = self._locate(g)
            by_file.setdefault(f, []).append((pos, local))
        for f, pairs in by_file.items():
            rows = self.tables[f].take([local for _, local in pairs]).to_pylist()
            for (pos, _), row in zip(pairs, rows):
                out[pos] = row
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ items
    def __len__(self) -> int:
        return len(self._keep)

    def _truncate(self, ids: list[int], global_row: int) -> list[int]:
        limit = self.config.max_prompt_length
        if len(ids) <= limit:
            return ids
        mode = self.config.truncation
        if mode == "left":
            return ids[-limit:]
        if mode == "right":
            return ids[:limit]
        f, local = self._locate(global_row)
        raise ValueError(
            f"{self.files[f]}: row {local}: prompt has {len(ids)} tokens, more than data.max_prompt_length="
            f"{limit}; raise max_prompt_length or set data.truncation to left, right or filter"
        )

    def _build(self, row: dict, ids: list[int], global_row: int) -> dict:
        ids = self._truncate(ids, global_row)
        input_ids, attention_mask = left_pad(ids, self.config.max_prompt_length, self.pad_token_id)
        messages = row.pop(self.config.prompt_key)
        item = dict(row)
        item["input_ids"] = input_ids
        item["attention_mask"] = attention_mask
        item["position_ids"] = compute_position_ids(attention_mask)
        item["raw_prompt_ids"] = list(ids)
        if self.config.return_raw_chat:
            item["raw_prompt"] = messages
        extra = row.get("extra_info") or {}
        item["index"] = extra.get("index", global_row) if isinstance(extra, dict) else global_row
        return item

    def __getitems__(self, indices) -> list[dict]:
        global_rows = [int(self._keep[i]) for i in indices]
        rows = self._fetch_rows(global_rows)
        texts = [render_prompt(r[self.config.prompt_key], self.tokenizer, self.config.apply_chat_template)
                 for r in rows]
        all_ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return [self._build(r, list(ids), g) for r, ids, g in zip(rows, all_ids, global_rows)]

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} prompts")
        return self.__getitems__([index % len(self)])[0]
