"""Batched generation as small pure functions (gpt-fast style): prefill, decode_one_token, generate.

All sequences of a batch advance together over a static cache. The loop only samples and
stores tokens -- no Python per sequence -- and leaves early once every row holds a stop
(checked every `sync_every` steps to bound host syncs); `finish_responses` then cuts each row
after its first stop (kept; later slots get the pad id and response_mask 0). With a decoder that
`takes_active_rows` (the fused one), rows found stopped at a check leave the batch's matmuls: the
later steps compute the rows still generating only (their samples are the same: each row keeps
its own uniforms), so a batch whose lengths vary costs about its tokens, not rows x longest.
A stop is a stop token or the last token of a stop sequence (params.stop_sequences, e.g. a tool
call's closing tag spelled in several tokens) sampled whole within the response (`stop_hits`).

Prefix sharing: with group_size g > 1 the B distinct prompts are prefilled once and each is decoded
as g rows (row i*g + j is sample j of prompt i, the rows `repeat_interleave(g)` gives); the
decoder, reset for (B, g), keeps the shared prompt keys (native/decoder.py).

Shapes: B batch (prompts), P padded prompt length, R response length, V vocab, B*g rows.
"""

from __future__ import annotations

from typing import Callable

import torch

from tinyzero.rollout.sampling import SampleBuffers, SamplingParams, draw_uniforms, sample_from_logits
from tinyzero.runtime.progress import report_progress

# decoder(input_ids (B,T), position_ids (B,T), key_valid (B,start+T) bool, start) -> logits (B,V)
Decoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def prefill(decoder: Decoder, prompt_ids: torch.Tensor, prompt_pos: torch.Tensor,
            key_valid: torch.Tensor) -> torch.Tensor:
    """Run the padded prompts (B, P) through the model; logits (B, V) of the last prompt slot."""
    return decoder(prompt_ids, prompt_pos, key_valid[:, : prompt_ids.shape[1]], 0)


def decode_one_token(decoder: Decoder, token: torch.Tensor, pos: torch.Tensor, key_valid: torch.Tensor,
                     slot: int, active: torch.Tensor | None = None) -> torch.Tensor:
    """Feed one token per sequence (B,) at position pos (B, 1) and cache slot `slot`; logits (B, V)
    for the next token, or (A, V) for the rows `active` (A,) only (a decoder with `takes_active_rows`)."""
    if active is None:
        return decoder(token[:, None], pos, key_valid[:, : slot + 1], slot)
    return decoder(token[:, None], pos, key_valid[:, : slot + 1], slot, active=active)


@torch.inference_mode()
def generate(decoder: Decoder, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_pos: torch.Tensor,
             params: SamplingParams, generator: torch.Generator | None, sync_every: int = 1, group_size: int = 1,
             uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate up to params.response_length tokens for each of the group_size rows of every prompt.

    uniforms: the sampler's (R, B*g) float64 uniforms, drawn here from `generator` when None.
    Returns responses (B*g, R) int64 right-padded with params.pad_token_id, response_mask (B*g, R) int64
    (1 up to and including the stop token) and log-probs (B*g, R) fp32 (0 where masked). Runs under
    inference_mode (no version counters or autograd bookkeeping per op: ~7% of a CPU decode step),
    so the three are inference tensors: copy them (any out-of-place op does) before writing into
    them; the caches the decoder allocated outside may be written in here."""
    P = prompt_ids.shape[1]
    B = prompt_ids.shape[0] * group_size  # rows
    R = params.response_length
    device = prompt_ids.device
    key_valid = torch.ones(B, P + R, dtype=torch.bool, device=device)
    key_valid[:, :P] = prompt_mask.bool().repeat_interleave(group_size, dim=0)
    # Position of response token t (fed at decode step t): one past the last prompt position, then +1 a step.
    last_pos = prompt_pos[:, -1:].repeat_interleave(group_size, dim=0)  # (B, 1)
    step_pos = last_pos + 1 + torch.arange(R, device=device)  # (B, R)
    if hasattr(decoder, "begin"):
        decoder.begin(key_valid, step_pos)
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    sequences = params.stop_sequences
    check_stop = stop_ids.numel() > 0 or bool(sequences)
    overlap = max((len(seq) for seq in sequences), default=1) - 1  # a sequence may straddle two checks
    tok_steps: list[torch.Tensor] = []  # (B,) per step, stacked at the end (no per-step copies)
    logp_steps: list[torch.Tensor] = []
    stopped = torch.zeros(B, dtype=torch.bool, device=device)  # rows holding a stop token (checked so far)
    checked = 0  # steps folded into `stopped`
    compact = bool(getattr(decoder, "takes_active_rows", False))
    active = None  # (A,) the rows still computed, once some have stopped (None: every row)

    # Every step's uniforms at once (R * B numbers): one generator call per batch, not one per step.
    if params.greedy:
        uniforms = None
    elif uniforms is None:
        uniforms = draw_uniforms((R, B), generator, device)
    logits = prefill(decoder, prompt_ids, prompt_pos, key_valid[:: group_size])  # (B / g, V) or (B, V)
    if logits.shape[0] != B:
        logits = logits.repeat_interleave(group_size, dim=0)  # (B, V): a prompt's rows share its first logits
    buffers = SampleBuffers()  # the sampler's (rows, V) tensors, reused by every step
    steps = R
    for t in range(R):
        report_progress("generate", token=t + 1, of=R)
        step_uniforms = None if uniforms is None else uniforms[t] if active is None else uniforms[t, active]
        tok, logp = sample_from_logits(logits, params, generator, step_uniforms, buffers)
        if active is not None:  # back to every row: the stopped ones get pad (cut by finish_responses)
            tok = torch.full((B,), params.pad_token_id, dtype=tok.dtype, device=device).index_copy_(0, active, tok)
            logp = torch.zeros(B, dtype=logp.dtype, device=device).index_copy_(0, active, logp)
        tok_steps.append(tok)
        logp_steps.append(logp)
        # Rows past their stop token keep decoding until the next check (and to the end with a decoder that
        # does not take active rows); what they sample is masked out below.
        if t == R - 1:
            break
        if check_stop and (t + 1) % sync_every == 0:
            window = torch.stack(tok_steps[max(0, checked - overlap):], dim=1)  # (B, steps since the last check)
            stopped |= stop_hits(window, stop_ids, sequences).any(dim=1)
            checked = t + 1
            if bool(stopped.all()):
                steps = t + 1
                break
            if compact and bool(stopped.any()):
                active = (~stopped).nonzero().squeeze(1)
        logits = decode_one_token(decoder, tok, step_pos[:, t:t + 1], key_valid, P + t, active)
    tokens = torch.full((B, R), params.pad_token_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(B, R, dtype=torch.float32, device=device)
    tokens[:, :steps] = torch.stack(tok_steps, dim=1)
    log_probs[:, :steps] = torch.stack(logp_steps, dim=1)
    return finish_responses(tokens, log_probs, stop_ids, steps, params.pad_token_id, sequences)


def stop_hits(tokens: torch.Tensor, stop_ids: torch.Tensor, stop_sequences: list[list[int]] = ()) -> torch.Tensor:
    """(B, T) bool: True at t where a stop ends -- tokens[:, t] is a stop id, or tokens[:, t-L+1 .. t] equal
    a stop sequence of length L. tokens: (B, T)."""
    hits = torch.isin(tokens, stop_ids.to(tokens.device)) if stop_ids.numel() else torch.zeros_like(tokens, dtype=torch.bool)
    for seq in stop_sequences:
        L = len(seq)
        if L > tokens.shape[1]:
            continue
        windows = tokens.unfold(1, L, 1)  # (B, T-L+1, L): windows[:, i] = tokens[:, i .. i+L-1]
        hits[:, L - 1:] |= (windows == torch.tensor(seq, dtype=tokens.dtype, device=tokens.device)).all(dim=-1)
    return hits


def finish_responses(tokens: torch.Tensor, log_probs: torch.Tensor, stop_ids: torch.Tensor,
                     lengths: int | torch.Tensor, pad_token_id: int,
                     stop_sequences: list[list[int]] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep each row up to and including its first stop (a stop token or the end of a stop sequence, see
    `stop_hits`; within its first `lengths` tokens: one count for every row, or a (B,) tensor of per-row
    counts); pad / zero the rest. tokens, log_probs: (B, R).
    Returns responses (B, R), response_mask (B, R) int64 and log_probs (B, R)."""
    R = tokens.shape[1]
    positions = torch.arange(R, device=tokens.device)
    if isinstance(lengths, torch.Tensor):
        in_range = positions[None, :] < lengths.to(tokens.device)[:, None]  # (B, R)
    else:
        in_range = (positions < lengths).expand(tokens.shape)  # (B, R)
    if stop_ids.numel() or stop_sequences:
        hits = stop_hits(tokens, stop_ids, stop_sequences).long()  # (B, R)
        stops_before = hits.cumsum(dim=1) - hits  # stops ending strictly before t
        mask = (stops_before == 0) & in_range
    else:
        mask = in_range
    responses = torch.where(mask, tokens, torch.full_like(tokens, pad_token_id))
    return responses, mask.long(), torch.where(mask, log_probs, torch.zeros_like(log_probs))
