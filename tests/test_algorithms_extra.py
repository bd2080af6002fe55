"""GPG and pass@k advantages, the GPG / Clip-Cov / KL-Cov policy losses, against float64 Python loops.

The references restate the papers' (and veRL's) formulas token by token; inputs are random with
right-padded masks, ragged groups and ties. Tolerance 1e-6 (float64 inputs).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from tinyzero.algorithms import get_adv_estimator_fn, get_policy_loss_fn
from tinyzero.workers.config import ActorConfig, PolicyLossConfig

TOL = 1e-6


def _batch(seed: int, rows: int = 12, length: int = 7, ties: bool = False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).double()  # (rows, R), right-padded
    scores = torch.randint(0, 3, (rows,), generator=g).double() if ties else torch.randn(rows, generator=g,
                                                                                            dtype=torch.float64)
    rewards = torch.zeros(rows, length, dtype=torch.float64)
    rewards[torch.arange(rows), lengths - 1] = scores  # outcome reward on the last valid token
    index = np.array([f"p{i % 4}" for i in range(rows)], dtype=object)  # 4 groups of 3
    return rewards, mask, index, scores.tolist()


def _groups(index) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, uid in enumerate(index):
        out.setdefault(uid, []).append(i)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_gpg_advantage_matches_loop(seed):
    rewards, mask, index, scores = _batch(seed, ties=True)
    index = np.concatenate([index[:-1], np.array(["alone"], dtype=object)])  # a group of one: mean 0
    adv, ret = get_adv_estimator_fn("gpg")(rewards, mask, index)
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    means = {uid: (statistics.fmean(scores[i] for i in rows) if len(rows) > 1 else 0.0)
             for uid, rows in _groups(index).items()}
    for i, uid in enumerate(index):
        for t in range(mask.shape[1]):
            want = alpha * (scores[i] - means[uid]) * float(mask[i, t])
            assert abs(float(adv[i, t]) - want) < TOL
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("ties,norm", [(False, True), (True, True), (True, False)])
def test_grpo_passk_advantage_matches_loop(ties, norm):
    rewards, mask, index, scores = _batch(3, ties=ties)
    adv, _ = get_adv_estimator_fn("grpo_passk")(rewards, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm)
    want = [0.0] * len(scores)
    for rows in _groups(index).values():
        ordered = sorted(rows, key=lambda i: (-scores[i], i))  # best first; ties: first in batch order
        gap = scores[ordered[0]] - scores[ordered[1]]
        if norm:
            gap /= statistics.stdev(scores[i] for i in rows) + 1e-6
        want[ordered[0]] = gap
    for i in range(len(scores)):
        for t in range(mask.shape[1]):
            assert abs(float(adv[i, t]) - want[i] * float(mask[i, t])) < TOL
    assert sum(1 for w in want if w != 0) <= len(_groups(index))  # one credited response per group at most


def test_grpo_passk_needs_two_responses_per_prompt():
    rewards, mask, _, _ = _batch(0, rows=3)
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        get_adv_estimator_fn("grpo_passk")(rewards, mask, np.array(["a", "a", "b"], dtype=object))


def _loss_inputs(seed: int, rows: int = 6, length: int = 9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).double()
    old = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 2
    logp = (old + torch.randn(rows, length, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    adv = torch.randn(rows, length, generator=g, dtype=torch.float64) * 2 * mask
    return old, logp, adv, mask


def _valid(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]


def test_gpg_loss_matches_loop():
    old, logp, adv, mask = _loss_inputs(0)
    loss, clipfrac, _, _ = get_policy_loss_fn("gpg")(old, logp, adv, mask, "token-mean")
    tokens = _valid(mask)
    want = sum(-float(logp.detach()[i, t]) * float(adv[i, t]) for i, t in tokens) / len(tokens)
    assert abs(float(loss.detach()) - want) < TOL and float(clipfrac) == 0.0
    loss.backward()
    for i, t in tokens:  # d loss / d log_prob = -A / tokens
        assert abs(float(logp.grad[i, t]) + float(adv[i, t]) / len(tokens)) < TOL


def _covariances(logp, adv, mask):
    logp = logp.detach()
    tokens = _valid(mask)
    mean_a = sum(float(adv[i, t]) for i, t in tokens) / len(tokens)
    mean_l = sum(float(logp[i, t]) for i, t in tokens) / len(tokens)
    return {(i, t): (float(adv[i, t]) - mean_a) * (float(logp[i, t]) - mean_l) for i, t in tokens}


def _config(**policy_loss):
    return ActorConfig(clip_ratio=0.2, policy_loss=PolicyLossConfig(**policy_loss))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_cuts_only_candidate_tokens(seed):
    old, logp, adv, mask = _loss_inputs(seed, rows=8, length=12)
    lb, ub = 0.05, 5.0
    cov = _covariances(logp, adv, mask)
    lp = logp.detach()

    def token_loss(i, t):
        ratio = math.exp(float(lp[i, t]) - float(old[i, t]))
        a = float(adv[i, t])
        return max(-a * ratio, -a * min(max(ratio, 0.8), 1.2)), -a * min(max(ratio, 0.8), 1.2) > -a * ratio

    candidates = {k for k, c in cov.items() if lb < c < ub and not token_loss(*k)[1]}
    assert candidates, "the inputs must give the selection something to do"
    tokens = _valid(mask)
    # ratio 1: every candidate is cut, so the loss is deterministic and checkable term by term.
    loss, clipfrac, ppo_kl, _ = get_policy_loss_fn("clip_cov")(
        old, logp, adv, mask, "token-mean", config=_config(clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub))
    want = sum(token_loss(i, t)[0] for i, t in tokens if (i, t) not in candidates) / len(tokens)
    assert abs(float(loss.detach()) - want) < TOL
    assert abs(float(clipfrac) - len(candidates) / len(tokens)) < TOL
    assert abs(float(ppo_kl) - sum(float(old[k] - lp[k]) for k in tokens) / len(tokens)) < TOL
    # A small ratio cuts max(int(ratio * tokens), 1) of them, chosen at random: the gradient is 0 there only.
    torch.manual_seed(seed)
    logp.grad = None
    loss, clipfrac, _, _ = get_policy_loss_fn("clip_cov")(
        old, logp, adv, mask, "token-mean", config=_config(clip_cov_ratio=0.02, clip_cov_lb=lb, clip_cov_ub=ub))
    loss.backward()
    num_cut = min(max(int(0.02 * len(tokens)), 1), len(candidates))
    cut = {k for k in tokens if float(logp.grad[k]) == 0.0 and float(adv[k]) != 0.0 and not token_loss(*k)[1]}
    assert len(cut) == num_cut and cut <= candidates
    assert abs(float(clipfrac) - num_cut / len(tokens)) < TOL


@pytest.mark.parametrize("ratio,coef", [(0.1, 1.0), (0.3, 0.5), (1e-4, 2.0)])
def test_kl_cov_penalises_top_covariance_tokens(ratio, coef):
    old, logp, adv, mask = _loss_inputs(4, rows=8, length=12)
    loss, _, ppo_kl, _ = get_policy_loss_fn("kl_cov")(
        old, logp, adv, mask, "token-mean", config=_config(kl_cov_ratio=ratio, ppo_kl_coef=coef))
    cov = _covariances(logp, adv, mask)
    lp = logp.detach()
    tokens = _valid(mask)
    k = max(1, int(len(tokens) * ratio))
    top = set(sorted(cov, key=lambda key: -cov[key])[:k])
    total = 0.0
    for i, t in tokens:
        log_ratio = float(lp[i, t]) - float(old[i, t])
        total += -float(adv[i, t]) * math.exp(log_ratio) + (coef * abs(log_ratio) if (i, t) in top else 0.0)
    assert abs(float(loss.detach()) - total / len(tokens)) < TOL
    assert abs(float(ppo_kl) - sum(abs(float(lp[k] - old[k])) for k in tokens) / len(tokens)) < TOL


def test_policy_loss_config_validation():
    for bad in (dict(clip_cov_ratio=0.0), dict(kl_cov_ratio=1.5), dict(clip_cov_lb=5.0, clip_cov_ub=1.0),
                dict(ppo_kl_coef=-1.0)):
        with pytest.raises(ValueError, match="policy_loss."):
            PolicyLossConfig(**bad)


def test_unknown_policy_loss_is_a_config_error():
    from tinyzero.cli import parse_args

    with pytest.raises((ValueError, SystemExit)):
        parse_args(["--preset", "demo_cpu", "--actor_rollout_ref.actor.policy_loss.loss_mode", "nope"])
    cfg = parse_args(["--preset", "demo_cpu", "--actor_rollout_ref.actor.policy_loss.loss_mode", "kl_cov",
                      "--actor_rollout_ref.actor.policy_loss.kl_cov_ratio", "0.01"])
    assert cfg.actor_rollout_ref.actor.policy_loss.kl_cov_ratio == 0.01


def test_cispo_matches_loop_and_keeps_every_gradient():
    old, logp, adv, mask = _loss_inputs(5, rows=8, length=12)
    cfg = ActorConfig(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.25)
    loss, clipfrac, ppo_kl, _ = get_policy_loss_fn("cispo")(old, logp, adv, mask, "token-mean", config=cfg)
    lp = logp.detach()
    tokens = _valid(mask)
    weights = {k: min(max(math.exp(float(lp[k] - old[k])), 0.9), 1.25) for k in tokens}
    want = sum(-weights[k] * float(adv[k]) * float(lp[k]) for k in tokens) / len(tokens)
    assert abs(float(loss.detach()) - want) < TOL
    clipped = sum(1 for k in tokens if weights[k] != math.exp(float(lp[k] - old[k])))
    assert 0 < clipped < len(tokens) and abs(float(clipfrac) - clipped / len(tokens)) < TOL
    assert abs(float(ppo_kl) - sum(float(old[k] - lp[k]) for k in tokens) / len(tokens)) < TOL
    loss.backward()
    for k in tokens:  # the weight is a constant: d loss / d log_prob = -w * A / tokens, clipped or not
        assert abs(float(logp.grad[k]) + weights[k] * float(adv[k]) / len(tokens)) < TOL


def test_gspo_needs_sequence_mean_aggregation():
    from tinyzero.cli import parse_args

    base = ["--preset", "demo_cpu", "--actor_rollout_ref.actor.policy_loss.loss_mode", "gspo"]
    with pytest.raises((ValueError, SystemExit)):
        parse_args(base + ["--actor_rollout_ref.actor.loss_agg_mode", "token-mean"])
    cfg = parse_args(base + ["--actor_rollout_ref.actor.loss_agg_mode", "seq-mean-token-mean"])
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
