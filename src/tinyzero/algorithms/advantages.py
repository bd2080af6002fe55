"""Advantage estimators, registered by name, and the `compute_advantage` driver.

Numerics follow veRL's `core_algos.py` reference loops (edge cases included: a group of one
has mean 0 / std 1, RLOO leaves a lone response unbaselined, GAE carries its state through
masked-out tokens and whitens every position with statistics of the valid ones). The
implementations are vectorised: reverse scans and per-group statistics come from
`tinyzero.kernels` (Triton on CUDA, torch elsewhere), with no Python loop over time steps or
groups. Deliberate differences from veRL: group statistics are computed in float64 and
rounded once (veRL accumulates in the score dtype), and the response mask is used as given
(0/1 expected, as in veRL).

A new estimator is one decorated function; its registry entry says what the trainer must
provide (the config checks and the trainer read these flags, never a list of names):

    @register_adv_est("my_estimator", needs_groups=True)
    def my_estimator(token_level_rewards, response_mask, index, **kwargs):
        ...
        return advantages, returns          # both (batch, response_len)

needs_groups: compares the responses of one prompt (uid groups): rollout.n >= 2 is required.
needs_critic: reads `values`: the run trains a value model.
needs_baseline: reads `reward_baselines`: the trainer scores a greedy rollout per prompt (ReMax).

Shape legend: B = batch (responses), R = response_len, G = number of uid groups.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from tinyzero.kernels import discounted_returns, gae_advantage_return, group_ids, group_mean_std, group_stats

from .functional import masked_whiten

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdvEstimatorSpec:
    """A registry entry: the estimator and what it needs from the trainer (see the module docstring)."""

    name: str
    fn: AdvantageFn
    needs_groups: bool = False
    needs_critic: bool = False
    needs_baseline: bool = False


ADV_ESTIMATORS: dict[str, AdvEstimatorSpec] = {}


def register_adv_est(name: str, *, needs_groups: bool = False, needs_critic: bool = False,
                     needs_baseline: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register an advantage estimator under `name` (a name may be bound once)."""
    name = getattr(name, "value", name)

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATORS and ADV_ESTIMATORS[name].fn is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered ({ADV_ESTIMATORS[name].fn})")
        ADV_ESTIMATORS[name] = AdvEstimatorSpec(name, fn, needs_groups, needs_critic, needs_baseline)
        return fn

    return decorator


def get_adv_estimator_spec(name: str) -> AdvEstimatorSpec:
    """The registry entry of `name`; ValueError listing the known names otherwise."""
    name = getattr(name, "value", name)
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


def get_adv_estimator_fn(name: str) -> AdvantageFn:
    """The estimator registered under `name`; ValueError listing the known names otherwise."""
    return get_adv_estimator_spec(name).fn


def _scores_and_groups(token_level_rewards: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor, int]:
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    ids, num_groups = group_ids(index, scores.device)  # (B,)
    if ids.numel() != scores.numel():
        raise ValueError(f"index has {ids.numel()} entries but the batch has {scores.numel()} responses")
    return scores, ids, num_groups


@register_adv_est("gae", needs_critic=True)
@torch.no_grad()
def compute_gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor,
                                 response_mask: torch.Tensor, gamma: float, lam: float, **kwargs):
    """GAE (Schulman et al. 2015) over valid tokens; advantages whitened over the mask.

    Returns (advantages, returns), (B, R). Masked-out tokens pass the running state through
    (their advantage is the next valid token's, 0 past the end) and are whitened like the
    others; returns = un-whitened advantages + values.
    """
    advantages, returns = gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)
    advantages = masked_whiten(advantages, response_mask)  # (B, R)
    return advantages, returns


@register_adv_est("grpo", needs_groups=True)
@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                   epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True, **kwargs):
    """GRPO outcome advantage: (score - group mean) / (group std + epsilon), broadcast over tokens.

    score = sum of token-level rewards; groups by `index` (the uid of each response's prompt).
    norm_adv_by_std_in_grpo=False drops the division (Dr. GRPO). Returns (adv, adv), (B, R).
    """
    scores, ids, num_groups = _scores_and_groups(token_level_rewards, index)
    mean, std, _ = group_mean_std(scores, ids, num_groups)  # (G,)
    centred = scores.to(mean.dtype) - mean[ids]  # (B,)
    if norm_adv_by_std_in_grpo:
        centred = centred / (std[ids] + epsilon)
    advantages = centred.to(scores.dtype).unsqueeze(-1) * response_mask  # (B, R)
    return advantages, advantages


@register_adv_est("rloo", needs_groups=True)
@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                   epsilon: float = 1e-6, **kwargs):
    """RLOO (Ahmadian et al. 2024): score minus the mean of the other responses of its group.

    Computed as n/(n-1) * (score - group mean); a group of one keeps its raw score.
    """
    scores, ids, num_groups = _scores_and_groups(token_level_rewards, index)
    count, mean, _ = group_stats(scores, ids, num_groups)  # (G,)
    n = count[ids]  # (B,)
    x = scores.to(mean.dtype)
    factor = n / (n - 1.0).clamp_min(1.0)
    loo = torch.where(n > 1, x * factor - mean[ids] * factor, x)  # (B,)
    advantages = loo.to(scores.dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("opo", needs_groups=True)
@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                  epsilon: float = 1e-6, **kwargs):
    """OPO (Hao et al. 2025): baseline = length-weighted mean score of the group (0 for a group of one)."""
    scores, ids, num_groups = _scores_and_groups(token_level_rewards, index)
    lengths = response_mask.sum(dim=-1).to(torch.float64)  # (B,)
    x = scores.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=x.device).index_add_(0, ids, torch.ones_like(x))
    num = torch.zeros_like(count).index_add_(0, ids, lengths * x)
    den = torch.zeros_like(count).index_add_(0, ids, lengths)
    baseline = torch.where(count > 1, num / den, torch.zeros_like(num))  # (G,)
    advantages = (x - baseline[ids]).to(scores.dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("gpg", needs_groups=True)
@torch.no_grad()
def compute_gpg_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                  f_norm: float = 1.0, **kwargs):
    """GPG (Chu et al. 2025): alpha * (score - group mean) / f_norm, alpha = B / (responses scoring != 0).

    No std division; a group of one has mean 0 (veRL's rule). alpha rescales the batch so that rows
    with a zero score (no signal) do not dilute the gradient. Pairs with policy loss "gpg".
    """
    scores, ids, num_groups = _scores_and_groups(token_level_rewards, index)
    mean, _, _ = group_mean_std(scores, ids, num_groups)  # (G,)
    alpha = scores.numel() / max(int(torch.count_nonzero(scores)), 1)
    advantages = (alpha * (scores.to(mean.dtype) - mean[ids]) / f_norm).to(scores.dtype)  # (B,)
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("grpo_passk", needs_groups=True)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                         epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True, **kwargs):
    """Pass@k training (Chen et al. 2025): only the best response of each group gets an advantage,
    r_max - r_second_max (over the group std + epsilon when norm_adv_by_std_in_grpo); the rest get 0.

    Among tied best responses the first in batch order is the one credited (its advantage is then 0).
    Every group needs at least 2 responses (rollout.n >= 2).
    """
    scores, ids, num_groups = _scores_and_groups(token_level_rewards, index)
    _, std, count = group_mean_std(scores, ids, num_groups)  # (G,)
    if bool((count < 2).any()):
        raise ValueError("advantage estimator 'grpo_passk' needs at least 2 responses per prompt; set "
                         "actor_rollout_ref.rollout.n >= 2")
    x = scores.to(std.dtype)  # (B,)
    rows = torch.arange(x.numel(), device=x.device)
    best = torch.full((num_groups,), float("-inf"), dtype=x.dtype, device=x.device).scatter_reduce(
        0, ids, x, reduce="amax")  # (G,)
    first_best = torch.full((num_groups,), x.numel(), dtype=torch.long, device=x.device).scatter_reduce(
        0, ids, torch.where(x == best[ids], rows, x.numel()), reduce="amin")  # (G,) row of each group's best
    is_best = rows == first_best[ids]  # (B,)
    second = torch.full_like(best, float("-inf")).scatter_reduce(
        0, ids, torch.where(is_best, torch.full_like(x, float("-inf")), x), reduce="amax")  # (G,)
    gap = best - second
    if norm_adv_by_std_in_grpo:
        gap = gap / (std + epsilon)
    advantages = torch.where(is_best, gap[ids], torch.zeros_like(x)).to(scores.dtype)  # (B,)
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus_baseline", needs_groups=True)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards: torch.Tensor,
                                                           response_mask: torch.Tensor, index,
                                                           epsilon: float = 1e-6, **kwargs):
    """REINFORCE++-baseline (Hu 2025): score minus group mean, broadcast, then whitened over the batch."""
    scores, ids, num_groups = _scores_and_groups(token_level_rewards, index)
    mean, _, _ = group_mean_std(scores, ids, num_groups)
    centred = (scores.to(mean.dtype) - mean[ids]).to(scores.dtype)  # (B,)
    tiled = centred.unsqueeze(-1).expand_as(token_level_rewards) * response_mask  # (B, R)
    advantages = masked_whiten(tiled, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                  gamma: float | None = None, config: Any = None, **kwargs):
    """REINFORCE++ (Hu 2025): discounted returns (reset after each masked-out token), whitened.

    gamma defaults to config.gamma (veRL reads it from the algorithm config) and then to 1.0.
    """
    if gamma is None:
        gamma = getattr(config, "gamma", 1.0) if config is not None else 1.0
    returns = discounted_returns(token_level_rewards, response_mask, gamma)  # (B, R)
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est("remax", needs_baseline=True)
@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor,
                                    response_mask: torch.Tensor, **kwargs):
    """ReMax (Li et al. 2023): reward-to-go minus the greedy rollout's reward (reward_baselines, (B,))."""
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])  # (B, R)
    advantages = returns - reward_baselines.reshape(-1, 1) * response_mask
    return advantages, returns


def compute_response_mask(data) -> torch.Tensor:
    """Response part of the attention mask (for batches that lack `response_mask`)."""
    response_length = data.batch["responses"].shape[1]
    return data.batch["attention_mask"][:, -response_length:]


def compute_advantage(data, adv_estimator: str, gamma: float = 1.0, lam: float = 1.0, num_repeat: int = 1,
                      norm_adv_by_std_in_grpo: bool = True, config: Any = None):
    """Write `advantages` and `returns` (B, R) into `data.batch` with the named estimator.

    Reads `token_level_rewards`, `response_mask` (or derives it from attention_mask /
    responses), and when present `values`, `reward_baselines` and the non-tensor `uid`
    (prompt groups). `num_repeat` is accepted for veRL compatibility (unused there too).
    Returns `data`.
    """
    del num_repeat
    fn = get_adv_estimator_fn(adv_estimator)
    batch = data.batch
    if "token_level_rewards" not in batch:
        raise ValueError("compute_advantage: batch lacks 'token_level_rewards' (set it from token_level_scores, "
                         "or run apply_kl_penalty first)")
    if "response_mask" not in batch:
        batch["response_mask"] = compute_response_mask(data)
    available: dict[str, Any] = {
        "token_level_rewards": batch["token_level_rewards"], "response_mask": batch["response_mask"],
        "gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo, "config": config,
    }
    for key in ("values", "reward_baselines"):
        if key in batch:
            available[key] = batch[key]
    if "uid" in data.non_tensor_batch:
        available["index"] = np.asarray(data.non_tensor_batch["uid"], dtype=object)
    params = inspect.signature(fn).parameters
    missing = [n for n, p in params.items()
               if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and n not in available]
    if missing:
        source = {"index": "the non-tensor 'uid' column", "values": "batch key 'values' (enable the critic)",
                  "reward_baselines": "batch key 'reward_baselines' (the greedy baseline rollout)"}
        raise ValueError(f"advantage estimator {adv_estimator!r} needs "
                         + ", ".join(source.get(n, repr(n)) for n in missing))
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in available.items() if takes_any or k in params}
    advantages, returns = fn(**kwargs)
    batch["advantages"] = advantages
    batch["returns"] = returns
    return data
