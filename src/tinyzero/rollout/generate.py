"""Batched generation as small pure functions (gpt-fast style): prefill, decode_one_token, generate.

All sequences of a batch advance together over a static cache; a finished mask stops a
sequence at its first stop token (that token is kept, later slots get the pad id and
response_mask 0). The loop does tensor work only -- no Python per sequence -- and leaves
early once every sequence is done (checked every `sync_every` steps to bound host syncs).

Shapes: B batch, P padded prompt length, R response length, V vocab.
"""

from __future__ import annotations

from typing import Callable

import torch

from tinyzero.rollout.sampling import SamplingParams, sample_from_logits

# decoder(input_ids (B,T), position_ids (B,T), key_valid (B,start+T) bool, start) -> logits (B,V)
Decoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def prefill(decoder: Decoder, prompt_ids: torch.Tensor, prompt_pos: torch.Tensor,
            key_valid: torch.Tensor) -> torch.Tensor:
    """Run the padded prompts (B, P) through the model; logits (B, V) of the last prompt slot."""
    return decoder(prompt_ids, prompt_pos, key_valid[:, : prompt_ids.shape[1]], 0)


def decode_one_token(decoder: Decoder, token: torch.Tensor, pos: torch.Tensor, key_valid: torch.Tensor,
                     slot: int) -> torch.Tensor:
    """Feed one token per sequence (B,) at cache slot `slot`; logits (B, V) for the next token."""
    return decoder(token[:, None], pos[:, None], key_valid[:, : slot + 1], slot)


@torch.no_grad()
def generate(decoder: Decoder, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_pos: torch.Tensor,
             params: SamplingParams, generator: torch.Generator | None,
             sync_every: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate up to params.response_length tokens for every row.

    Returns responses (B, R) int64 right-padded with params.pad_token_id, response_mask (B, R) int64
    (1 up to and including the stop token) and log-probs (B, R) fp32 (0 where masked)."""
    B, P = prompt_ids.shape
    R = params.response_length
    device = prompt_ids.device
    key_valid = torch.ones(B, P + R, dtype=torch.bool, device=device)
    key_valid[:, :P] = prompt_mask.bool()
    responses = torch.full((B, R), params.pad_token_id, dtype=torch.long, device=device)
    response_mask = torch.zeros(B, R, dtype=torch.long, device=device)
    log_probs = torch.zeros(B, R, dtype=torch.float32, device=device)
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    pad = torch.full((B,), params.pad_token_id, dtype=torch.long, device=device)
    next_pos = prompt_pos[:, -1] + 1  # (B,)

    logits = prefill(decoder, prompt_ids, prompt_pos, key_valid)
    for t in range(R):
        token, logp = sample_from_logits(logits, params, generator)
        alive = ~finished
        responses[:, t] = torch.where(alive, token, pad)
        response_mask[:, t] = alive.long()
        log_probs[:, t] = torch.where(alive, logp, torch.zeros_like(logp))
        if stop_ids.numel():
            finished = finished | torch.isin(token, stop_ids)
        if t == R - 1 or ((t + 1) % sync_every == 0 and bool(finished.all())):
            break
        logits = decode_one_token(decoder, responses[:, t], next_pos + t, key_valid, P + t)
    return responses, response_mask, log_probs
