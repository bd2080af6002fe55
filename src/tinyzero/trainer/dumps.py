"""Generation dumps as veRL writes them (trainer.rollout_data_dir, trainer.validation_data_dir).

    texts = decode_texts(tokenizer, batch)                       # prompts and responses, special tokens dropped
    dump_generations(dir, step, *texts, gts, scores, extra)      # DIR/<step>.jsonl, on rank 0
    dump_batch(tokenizer, batch, dir, step)                      # a training batch (trainer.rollout_data_dir)

One JSON object per line and per response: `input`, `output`, `gts` (the ground truth), `score`, `step`,
then every reward_extra_info key holding one value per response (a key named like a field replaces it,
as in veRL). The file is written whole to a temporary name and renamed, so a reader never sees half of
it; a rerun of the same step replaces it.
"""

from __future__ import annotations

import json
import os

import numpy as np

from tinyzero.distributed import get_rank
from tinyzero.protocol import DataProto
from tinyzero.runtime.fileio import atomic_write_text


def _jsonable(value):
    """numpy scalars and arrays as Python values; anything else JSON cannot hold as its text."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return str(value)


def decode_texts(tokenizer, batch: DataProto) -> tuple[list[str], list[str]]:
    """(inputs, outputs): each row's prompt and response tokens under the attention mask, decoded without
    special tokens (veRL decodes the padded rows with skip_special_tokens=True; the mask also drops a pad id
    that is not a special token)."""
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    mask = batch.batch["attention_mask"].bool().cpu()
    width = prompts.shape[1]
    prompt_ids = [row[m].tolist() for row, m in zip(prompts.cpu(), mask[:, :width])]
    response_ids = [row[m].tolist() for row, m in zip(responses.cpu(), mask[:, width:])]
    return (tokenizer.batch_decode(prompt_ids, skip_special_tokens=True),
            tokenizer.batch_decode(response_ids, skip_special_tokens=True))


def ground_truths(batch: DataProto) -> list:
    """Each row's reward_model["ground_truth"] (None where the row has none)."""
    rows = batch.non_tensor_batch.get("reward_model")
    if rows is None:
        return [None] * len(batch)
    return [r.get("ground_truth") if isinstance(r, dict) else None for r in rows]


def dump_generations(dump_dir: str, step: int, inputs: list, outputs: list, gts: list, scores: list,
                     extra: dict[str, list]) -> str | None:
    """Write DUMP_DIR/<step>.jsonl on rank 0 (see the module docstring); returns its path there, None elsewhere."""
    if get_rank() != 0:
        return None
    num = len(inputs)
    columns = {"input": inputs, "output": outputs, "gts": gts, "score": scores, "step": [step] * num}
    columns.update({k: list(v) for k, v in extra.items() if len(v) == num})
    lines = [json.dumps({k: v[i] for k, v in columns.items()}, ensure_ascii=False, default=_jsonable)
             for i in range(num)]
    os.makedirs(dump_dir, exist_ok=True)
    path = os.path.join(dump_dir, f"{step}.jsonl")
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def extra_info_rows(extra: dict[str, list], num: int) -> np.ndarray:
    """reward_extra_info (key -> one value per response) as one dict per row, an object array that travels with
    the batch's rows through filtering and balancing (a key with another length is left out, as in the dump)."""
    rows = np.empty(num, dtype=object)
    for i in range(num):
        rows[i] = {k: v[i] for k, v in extra.items() if len(v) == num}
    return rows


def dump_batch(tokenizer, batch: DataProto, dump_dir: str, step: int) -> str | None:
    """A training batch's responses to DUMP_DIR/<step>.jsonl: the score is the row's token_level_scores sum,
    the extra keys come from its `reward_extra_info` rows (extra_info_rows), None where a row lacks one."""
    inputs, outputs = decode_texts(tokenizer, batch)
    rows = batch.non_tensor_batch.get("reward_extra_info")
    rows = [] if rows is None else list(rows)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    extra = {k: [row.get(k) for row in rows] for k in keys}
    scores = batch.batch["token_level_scores"].sum(-1).tolist()
    return dump_generations(dump_dir, step, inputs, outputs, ground_truths(batch), scores, extra)
