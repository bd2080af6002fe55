"""Reverse linear scans over the response axis: GAE and discounted returns.

All advantage recurrences of PPO-style trainers are first-order linear recurrences run
backwards in time,

    x[t] = b[t] + a[t] * x[t + 1],        x[R] = 0,

with per-token coefficients built from the response mask. This module solves them without a
Python loop over time steps:

* torch path, right-padded masks (the normal case: every response is a prefix of valid
  tokens): the recurrences reduce to a discounted reverse cumulative sum with one constant
  factor c, computed as a blocked Toeplitz matmul: each block of K tokens is multiplied by
  the fixed K x K matrix of powers c^(s-t) (s >= t), and the block totals are carried across
  blocks by the same routine one level up (c^K per block). Only powers c^n <= 1 appear, so
  nothing overflows, and each sum has at most K terms per level.
* torch path, masks with holes (multi-turn observation tokens) or fractional masks: a
  Hillis-Steele doubling scan over (a, b) pairs, log2(R) vectorised steps. It only
  multiplies coefficients and adds, so rounding grows like log2(R) * eps.
* Triton path (CUDA, or the interpreter): one program per row walks the row in blocks from
  the end, solving each block with `tl.associative_scan` and carrying the state between
  blocks; one launch covers the whole batch.

Shapes: (batch, response_len) everywhere; outputs keep the input dtype.
"""

from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=64)
def _discount_matrices(c: float, k: int, dtype: torch.dtype, device: torch.device):
    """(T^T, tail) for block size k: T[t, s] = c^(s - t) for s >= t else 0; tail[j] = c^(k - j)."""
    pos = torch.arange(k, dtype=torch.float64)
    expo = pos[None, :] - pos[:, None]  # (K, K): s - t
    base = torch.tensor(c, dtype=torch.float64)
    toeplitz = torch.where(expo >= 0, torch.pow(base, expo.clamp_min(0)), torch.zeros((), dtype=torch.float64))
    tail = torch.pow(base, k - pos)
    return toeplitz.T.contiguous().to(dtype=dtype, device=device), tail.to(dtype=dtype, device=device)


def discounted_reverse_cumsum(x: torch.Tensor, c: float, block: int = 32) -> torch.Tensor:
    """y[t] = sum_{s >= t} c^(s - t) * x[s] along the last dim of a 2-D tensor, 0 <= c <= 1.

    Blocked: y = x_blocks @ T^T with T[t, s] = c^(s - t) inside each block, plus the next
    block's start value times c^(K - t mod K); the block start values solve the same problem
    with factor c^K over the blocks (recursion depth log_K(R)).
    """
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"discount factor must be in [0, 1]; got {c}")
    rows, length = x.shape
    k = min(block, max(length, 1))
    num_blocks = -(-length // k)
    toeplitz_t, tail = _discount_matrices(float(c), k, x.dtype, x.device)
    if num_blocks * k != length:
        x = torch.nn.functional.pad(x, (0, num_blocks * k - length))
    local = (x.reshape(rows * num_blocks, k) @ toeplitz_t).view(rows, num_blocks, k)  # sums inside blocks
    if num_blocks > 1:
        starts = discounted_reverse_cumsum(local[:, :, 0], float(c) ** k, block)  # (B, C): y at block starts
        nxt = torch.cat([starts[:, 1:], torch.zeros_like(starts[:, :1])], dim=1)  # (B, C)
        local.addcmul_(nxt.unsqueeze(-1), tail)
    local = local.view(rows, num_blocks * k)
    return local if num_blocks * k == length else local[:, :length]


def is_right_padded(mask: torch.Tensor) -> bool:
    """True when every row of the 0/1 mask is a run of ones followed by zeros."""
    lengths = mask.sum(dim=-1, keepdim=True)  # (B, 1)
    prefix = torch.arange(mask.shape[-1], device=mask.device) < lengths
    return bool(torch.equal(mask, prefix.to(mask.dtype)))


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
    if 0.0 <= gamma * lam <= 1.0 and is_right_padded(mask):
        # the next valid token is simply t + 1 (or none), and adv is a discounted cumsum of delta
        shift_mask = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)  # m[t+1]
        shift_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # v[t+1]
        delta = rewards + gamma * (shift_mask * shift_values) - values  # (batch, R)
        advantages = discounted_reverse_cumsum(mask * delta, gamma * lam)
        return advantages, advantages + values
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
    if not use_triton(rewards, backend) and 0.0 <= gamma <= 1.0 and is_right_padded(mask):
        # valid prefix: discounted cumsum of the valid rewards; padding keeps its own reward
        return torch.where(mask > 0, discounted_reverse_cumsum(rewards * mask, gamma), rewards)
    coeff = gamma * torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)  # (batch, R)
    return reverse_linear_scan(coeff, rewards, backend=backend)
