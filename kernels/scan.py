"""Reverse linear scans over the response axis: GAE and discounted returns.

All advantage recurrences of PPO-style trainers are first-order linear recurrences run
backwards in time,

    x[t] = b[t] + a[t] * x[t + 1],        x[R] = 0,

with per-token coefficients built from the response mask. This module solves them without a
Python loop over time steps:

* torch path: a Hillis-Steele doubling scan, log2(R) vectorised steps over the whole
  (batch, R) tensor. It only multiplies coefficients (all in [0, 1] for valid gamma / lam)
  and adds, so the rounding error grows like log2(R) * eps instead of R * eps for the
  sequential loop; nothing is divided and nothing can overflow.
* Triton path (CUDA, or the interpreter): one program per row walks the row in blocks from
  the end, solving each block with `tl.associative_scan` and carrying the state between
  blocks; one launch covers the whole batch.

Shapes: (batch, response_len) everywhere; outputs keep the input dtype.
"""

from __future__ import annotations

import torch

from ._backend import use_triton


def _check_2d(name: str, x: torch.Tensor, shape: torch.Size | None = None) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (batch, response_len); got shape {tuple(x.shape)}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but token_level_rewards has {tuple(shape)}")


def reverse_linear_scan_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x[t] = b[t] + a[t] * x[t+1] along the last dim (x past the end is 0); doubling scan.

    After step k, (a_k[t], x_k[t]) describe the composition of the 2^k maps starting at t,
    so x_k[t] is the exact answer once 2^k >= R - t.
    """
    a, x = torch.broadcast_tensors(a, b)
    x = x.clone()
    a = a.clone()
    length = x.shape[-1]
    step = 1
    while step < length:  # log2(R) iterations, each vectorised over the whole tensor
        head = torch.addcmul(x[..., :-step], a[..., :-step], x[..., step:])  # (..., R - step)
        x = torch.cat([head, x[..., -step:]], dim=-1)
        if 2 * step < length:
            a = torch.cat([a[..., :-step] * a[..., step:], torch.zeros_like(a[..., -step:])], dim=-1)
        step *= 2
    return x


def reverse_linear_scan(a: torch.Tensor, b: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Solve x[t] = b[t] + a[t] * x[t+1] over the last axis of 2-D (batch, len) tensors."""
    _check_2d("b", b)
    _check_2d("a", a, b.shape)
    if use_triton(b, backend) and b.dtype != torch.float64:
        from . import scan_triton

        return scan_triton.reverse_linear_scan(a, b)
    return reverse_linear_scan_torch(a, b)


def gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                         gamma: float, lam: float, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Un-whitened GAE advantages and returns, exactly the recurrences of veRL's loop.

    veRL carries two states backwards: `nextvalues` (the value of the next valid token) and
    `lastgaelam`; a masked-out token passes both through unchanged:

        nv[t]  = m[t] * v[t] + (1 - m[t]) * nv[t+1]
        delta  = r[t] + gamma * nv[t+1] - v[t]
        adv[t] = m[t] * delta + (m[t] * gamma * lam + 1 - m[t]) * adv[t+1]

    returns = adv + values. Masks may hold holes (multi-turn observation tokens).
    """
    _check_2d("token_level_rewards", token_level_rewards)
    _check_2d("values", values, token_level_rewards.shape)
    _check_2d("response_mask", response_mask, token_level_rewards.shape)
    dtype = torch.promote_types(token_level_rewards.dtype, values.dtype)
    rewards = token_level_rewards.to(dtype)
    values = values.to(dtype)
    mask = response_mask.to(dtype)
    if use_triton(rewards, backend) and dtype != torch.float64:
        from . import scan_triton

        return scan_triton.gae_advantage_return(rewards, values, mask, float(gamma), float(lam))
    next_values = reverse_linear_scan_torch(1.0 - mask, mask * values)  # (batch, R): nv[t]
    next_values = torch.cat([next_values[:, 1:], torch.zeros_like(next_values[:, :1])], dim=1)  # nv[t+1]
    delta = rewards + gamma * next_values - values  # (batch, R)
    coeff = mask * (gamma * lam) + (1.0 - mask)  # (batch, R)
    advantages = reverse_linear_scan_torch(coeff, mask * delta)
    return advantages, advantages + values


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float,
                       backend: str = "auto") -> torch.Tensor:
    """REINFORCE++ returns with veRL's reset after each masked-out token.

    veRL stores returns[t] = r[t] + gamma * running, then sets running = returns[t] * m[t];
    hence returns[t] = r[t] + gamma * m[t+1] * returns[t+1] (m past the end is 0).
    """
    _check_2d("token_level_rewards", token_level_rewards)
    _check_2d("response_mask", response_mask, token_level_rewards.shape)
    rewards = token_level_rewards
    mask = response_mask.to(rewards.dtype)
    coeff = gamma * torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)  # (batch, R)
    return reverse_linear_scan(coeff, rewards, backend=backend)
