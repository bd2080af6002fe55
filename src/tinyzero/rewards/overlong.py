"""DAPO's overlong reward shaping: a linear penalty over the last tokens before the length limit.

For a response of L valid tokens, with M = data.max_response_length and B = overlong_buffer.len
(veRL's DAPORewardManager, reward_model.overlong_buffer):

    expected_len = M - B
    exceed       = L - expected_len
    penalty      = min(-exceed / B * penalty_factor, 0)     # 0 up to M - B tokens, -penalty_factor at M

The penalty is added to the sample's score where the score sits (the last valid response token),
so token_level_scores carry it and everything after (the filter's seq_reward, advantages) sees it.
The per-sample "score" and "acc" of the scorer stay unshaped, as in veRL.

    scores = apply_overlong_penalty(token_level_scores, lengths, cfg.overlong_buffer, metrics)
"""

from __future__ import annotations

import torch

from tinyzero.rewards.config import OverlongBufferConfig

__all__ = ["apply_overlong_penalty", "overlong_penalty"]


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """(batch,) float32 penalties (<= 0) for (batch,) valid response lengths."""
    if not 1 <= buffer_len <= max_response_length:
        raise ValueError(f"reward.overlong_buffer.len={buffer_len} must be in [1, data.max_response_length="
                         f"{max_response_length}]; lower overlong_buffer.len")
    exceed = lengths.to(torch.float64) - (max_response_length - buffer_len)  # (batch,)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0).to(torch.float32)


def apply_overlong_penalty(token_level_scores: torch.Tensor, lengths: torch.Tensor, config: OverlongBufferConfig,
                           metrics: dict[str, float], max_response_length: int | None = None) -> torch.Tensor:
    """token_level_scores (batch, response_len) with the penalty added at each response's last valid token.

    The response width is data.max_response_length: every rollout engine pads responses to it. A
    sample with an empty response has no token to carry a penalty (and gets none: L = 0 <= M - B).
    Adds reward/overlong_penalty/mean and reward/overlong_rate (the fraction of penalised samples)
    to `metrics`. Returns the input unchanged when config.enable is False.
    """
    if not config.enable:
        return token_level_scores
    batch_size, width = token_level_scores.shape
    max_response_length = width if max_response_length is None else max_response_length  # veRL's max_resp_len
    lengths = lengths.to(token_level_scores.device)
    penalty = overlong_penalty(lengths, max_response_length, config.len, config.penalty_factor)  # (batch,)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    shaped = token_level_scores.clone()
    shaped[rows, lengths[rows] - 1] += penalty[rows]
    metrics["reward/overlong_penalty/mean"] = float(penalty.mean()) if batch_size else 0.0
    metrics["reward/overlong_rate"] = float((penalty < 0).float().mean()) if batch_size else 0.0
    return shaped
