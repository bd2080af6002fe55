"""Turn a prompt batch into engine inputs and engine results into the rollout DataProto.

Output keys (veRL names; B prompts, n samples each, rows of prompt i are i*n .. i*n+n-1):
  prompts (B*n, P), responses (B*n, R), input_ids / attention_mask / position_ids (B*n, P+R),
  response_mask (B*n, R) int64, rollout_log_probs (B*n, R) fp32.
Response position ids continue from the last prompt position (veRL: position_ids[:, -1:] + 1..R).
"""

from __future__ import annotations

import numpy as np
import torch

from tinyzero.protocol import DataProto
from tinyzero.rollout.generate import finish_responses

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


def check_prompt_batch(prompts: DataProto) -> None:
    """Fail with a clear message when the prompt batch lacks a key or is not left-padded."""
    missing = [k for k in PROMPT_KEYS if k not in prompts.batch]
    if missing:
        raise ValueError(f"prompt batch lacks {missing}; generate_sequences needs input_ids, attention_mask "
                         "and position_ids (B, P), left-padded")
    mask = prompts.batch["attention_mask"]
    if mask.numel() and not bool(mask[:, -1].bool().all()):
        raise ValueError("prompts must be left-padded (the last column of attention_mask must be 1); "
                         "set the tokenizer's padding_side='left'")


def repeat_prompts(prompts: DataProto, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, pos) of shape (B*n, P), rows of one prompt adjacent."""
    out = []
    for key in PROMPT_KEYS:
        t = prompts.batch[key]
        out.append(t.repeat_interleave(n, dim=0) if n > 1 else t)
    return tuple(out)


def raw_prompt_token_ids(prompts: DataProto) -> list[list[int]]:
    """Unpadded prompt ids per row, read from input_ids where attention_mask is 1 (so the engine
    always sees exactly the prompt the trainer scores, whatever `raw_prompt_ids` holds)."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
    return [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]


def pad_responses(token_lists: list[list[int]], logprob_lists: list[list[float]], length: int,
                  pad_token_id: int, stop_token_ids: list[int],
                  stop_sequences: list[list[int]] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ragged responses to `length`; cut each after its first stop token or stop sequence
    (finish_responses).
    Returns responses (rows, length) int64, response_mask (rows, length) int64, log_probs (rows, length) fp32."""
    rows = len(token_lists)
    tokens = torch.full((rows, length), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros(rows, length, dtype=torch.float32)
    lengths = torch.zeros(rows, dtype=torch.long)  # tokens per row
    num_log_probs = torch.zeros(rows, dtype=torch.long)  # log-probs per row
    for i, (toks, lps) in enumerate(zip(token_lists, logprob_lists)):
        toks, lps = list(toks)[:length], list(lps)[:length]
        lengths[i], num_log_probs[i] = len(toks), len(lps)
        if toks:
            tokens[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        if lps:
            log_probs[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    stop_ids = torch.tensor(list(stop_token_ids), dtype=torch.long)
    responses, mask, log_probs = finish_responses(tokens, log_probs, stop_ids, lengths, pad_token_id, stop_sequences)
    short = (mask.sum(dim=1) > num_log_probs).nonzero()
    if short.numel():
        i = int(short[0])
        raise ValueError(f"response {i} keeps {int(mask[i].sum())} tokens but has {int(num_log_probs[i])} log-probs; "
                         "the engine must return one log-prob per generated token")
    return responses, mask, log_probs


def build_output(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_pos: torch.Tensor,
                 responses: torch.Tensor, response_mask: torch.Tensor, log_probs: torch.Tensor,
                 meta_info: dict | None = None, non_tensors: dict | None = None) -> DataProto:
    """Assemble the rollout DataProto from (B*n, P) prompt tensors and (B*n, R) results (same device)."""
    R = responses.shape[1]
    delta = torch.arange(1, R + 1, device=prompt_pos.device, dtype=prompt_pos.dtype)
    response_pos = prompt_pos[:, -1:] + delta[None]  # (B*n, R)
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask.to(response_mask.dtype), response_mask], dim=1),
        "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs.float(),
    }
    non_tensors = {k: np.asarray(v, dtype=object) for k, v in (non_tensors or {}).items()}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(meta_info or {}))
