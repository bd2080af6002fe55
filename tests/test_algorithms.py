"""Advantage estimators and the compute_advantage driver against float64 reference loops.

The references below are straightforward per-row / per-group Python loops in float64 that
restate veRL's semantics (core_algos.py). Inputs are random with right-padded masks that include
empty and one-token responses, groups of size 1 and 2, and tied scores. Tolerance: 1e-6 for
float64 inputs, 1e-5 for float32 (absolute and relative, torch.testing.assert_close).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from tinyzero.algorithms import (
    ADV_ESTIMATORS,
    AlgorithmConfig,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    masked_var,
    masked_whiten,
    register_adv_est,
)
from tinyzero.protocol import DataProto

TOL = {torch.float64: 1e-6, torch.float32: 1e-5}
DTYPES = [torch.float64, torch.float32]


# ----------------------------------------------------------------------------- inputs
def make_batch(seed: int, dtype: torch.dtype, batch: int = 13, length: int = 17, holes: bool = False):
    """Random rewards/values, right-padded masks (lengths incl. 0, 1, full), uid groups of size 1, 2, 3, 4."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=g)
    lengths[0], lengths[1], lengths[2] = 0, 1, length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(dtype)  # (B, R)
    if holes:  # observation tokens inside a response (multi-turn)
        mask = mask * (torch.rand(batch, length, generator=g) > 0.2).to(dtype)
    dense = torch.randn(batch, length, generator=g, dtype=torch.float64).to(dtype) * mask
    values = torch.randn(batch, length, generator=g, dtype=torch.float64).to(dtype)
    # outcome rewards in {0, 0.5, 1} (ties inside groups) at the last valid token
    outcome = torch.zeros(batch, length, dtype=dtype)
    scores = torch.randint(0, 3, (batch,), generator=g).to(dtype) / 2
    for i in range(batch):
        if lengths[i] > 0:
            outcome[i, lengths[i] - 1] = scores[i]
    sizes = [1, 2, 3, 4, 1, 2]
    uid = []
    for k, s in enumerate(sizes):
        uid += [f"prompt-{k}"] * s
    uid = (uid + [f"prompt-x{i}" for i in range(batch)])[:batch]
    perm = torch.randperm(batch, generator=g).tolist()
    uid = np.array([uid[p] for p in perm], dtype=object)
    return dict(dense=dense, values=values, mask=mask, outcome=outcome, uid=uid)


def ref_whiten(x: list[list[float]], m: list[list[float]]) -> list[list[float]]:
    flat = [(xi, mi) for rx, rm in zip(x, m) for xi, mi in zip(rx, rm)]
    n = sum(mi for _, mi in flat)
    mean = sum(xi * mi for xi, mi in flat) / (n + 1e-8)
    var = sum((xi - mean) ** 2 * mi for xi, mi in flat) / (n + 1e-8) * n / (n - 1)
    return [[(xi - mean) / math.sqrt(var + 1e-8) for xi in rx] for rx in x]


def ref_group_stats(scores: list[float], uid) -> tuple[dict, dict, dict]:
    groups = defaultdict(list)
    for s, u in zip(scores, uid):
        groups[u].append(s)
    mean, std = {}, {}
    for u, xs in groups.items():
        if len(xs) == 1:
            mean[u], std[u] = 0.0, 1.0
        else:
            mu = sum(xs) / len(xs)
            mean[u] = mu
            std[u] = math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))
    return groups, mean, std


def as64(x: torch.Tensor) -> list[list[float]]:
    return x.double().tolist()


def check(out: torch.Tensor, ref, dtype: torch.dtype) -> None:
    ref = torch.as_tensor(ref, dtype=torch.float64)
    assert out.dtype == dtype, (out.dtype, dtype)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


# ----------------------------------------------------------------------------- GAE
def ref_gae(r, v, m, gamma, lam):
    rows, length = len(r), len(r[0])
    adv = [[0.0] * length for _ in range(rows)]
    for i in range(rows):
        next_value, last = 0.0, 0.0
        for t in reversed(range(length)):
            delta = r[i][t] + gamma * next_value - v[i][t]
            new_last = delta + gamma * lam * last
            next_value = v[i][t] * m[i][t] + (1 - m[i][t]) * next_value
            last = new_last * m[i][t] + (1 - m[i][t]) * last
            adv[i][t] = last
    returns = [[a + vv for a, vv in zip(ra, rv)] for ra, rv in zip(adv, v)]
    return ref_whiten(adv, m), returns


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_reference_loop(dtype, gamma, lam, holes):
    b = make_batch(1, dtype, holes=holes)
    adv, ret = compute_gae_advantage_return(b["dense"], b["values"], b["mask"], gamma, lam)
    ref_adv, ref_ret = ref_gae(as64(b["dense"]), as64(b["values"]), as64(b["mask"]), gamma, lam)
    check(adv, ref_adv, dtype)
    check(ret, ref_ret, dtype)


def test_gae_long_sequence_float32():
    """A long response (2053 tokens, not a power of two) stays within the float32 tolerance."""
    b = make_batch(7, torch.float32, batch=4, length=2053)
    adv, ret = compute_gae_advantage_return(b["dense"], b["values"], b["mask"], 0.999, 0.97)
    ref_adv, ref_ret = ref_gae(as64(b["dense"]), as64(b["values"]), as64(b["mask"]), 0.999, 0.97)
    check(adv, ref_adv, torch.float32)
    check(ret, ref_ret, torch.float32)


def test_masked_whiten_needs_two_valid_tokens():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="no element"):
        masked_var(x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="one element"):
        masked_whiten(x, torch.tensor([[1.0, 0, 0], [0, 0, 0]]))


# ----------------------------------------------------------------------------- outcome estimators
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(dtype, norm):
    b = make_batch(2, dtype)
    adv, ret = compute_grpo_outcome_advantage(b["outcome"], b["mask"], b["uid"], norm_adv_by_std_in_grpo=norm)
    scores = [sum(row) for row in as64(b["outcome"])]
    _, mean, std = ref_group_stats(scores, b["uid"])
    ref = []
    for i, s in enumerate(scores):
        u = b["uid"][i]
        a = (s - mean[u]) / (std[u] + 1e-6) if norm else s - mean[u]
        ref.append([a * m for m in as64(b["mask"])[i]])
    check(adv, ref, dtype)
    assert ret is adv or torch.equal(ret, adv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rloo_matches_reference(dtype):
    b = make_batch(3, dtype)
    adv, _ = compute_rloo_outcome_advantage(b["outcome"], b["mask"], b["uid"])
    scores = [sum(row) for row in as64(b["outcome"])]
    groups, _, _ = ref_group_stats(scores, b["uid"])
    ref = []
    for i, s in enumerate(scores):
        xs = groups[b["uid"][i]]
        a = s - (sum(xs) - s) / (len(xs) - 1) if len(xs) > 1 else s
        ref.append([a * m for m in as64(b["mask"])[i]])
    check(adv, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opo_matches_reference(dtype):
    b = make_batch(4, dtype)
    mask = b["mask"].clone()
    mask[:, 0] = 1  # OPO divides by the group's total length: keep every response non-empty
    adv, _ = compute_opo_outcome_advantage(b["outcome"], mask, b["uid"])
    scores = [sum(row) for row in as64(b["outcome"])]
    lengths = [sum(row) for row in as64(mask)]
    ref = []
    for i, s in enumerate(scores):
        members = [j for j in range(len(scores)) if b["uid"][j] == b["uid"][i]]
        base = 0.0
        if len(members) > 1:
            base = sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members)
        ref.append([(s - base) * m for m in as64(mask)[i]])
    check(adv, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reinforce_plus_plus_baseline_matches_reference(dtype):
    b = make_batch(5, dtype)
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(b["outcome"], b["mask"], b["uid"])
    scores = [sum(row) for row in as64(b["outcome"])]
    _, mean, _ = ref_group_stats(scores, b["uid"])
    m = as64(b["mask"])
    tiled = [[(s - mean[b["uid"][i]]) * mm for mm in m[i]] for i, s in enumerate(scores)]
    white = ref_whiten(tiled, m)
    check(adv, [[w * mm for w, mm in zip(rw, rm)] for rw, rm in zip(white, m)], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_matches_reference(dtype, holes):
    b = make_batch(6, dtype, holes=holes)
    gamma = 0.97
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(b["dense"], b["mask"], gamma=gamma)
    r, m = as64(b["dense"]), as64(b["mask"])
    ref_ret = []
    for i in range(len(r)):
        running, row = 0.0, [0.0] * len(r[i])
        for t in reversed(range(len(r[i]))):
            running = r[i][t] + gamma * running
            row[t] = running
            running = running * m[i][t]
        ref_ret.append(row)
    white = ref_whiten(ref_ret, m)
    check(ret, ref_ret, dtype)
    check(adv, [[w * mm for w, mm in zip(rw, rm)] for rw, rm in zip(white, m)], dtype)
    # gamma from the algorithm config when not passed (veRL reads config.gamma)
    adv2, _ = compute_reinforce_plus_plus_outcome_advantage(b["dense"], b["mask"], config=AlgorithmConfig(gamma=gamma))
    torch.testing.assert_close(adv2, adv, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_remax_matches_reference(dtype):
    b = make_batch(8, dtype)
    baselines = torch.randn(13, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    adv, ret = compute_remax_outcome_advantage(b["dense"], baselines, b["mask"])
    r, m = as64(b["dense"]), as64(b["mask"])
    ref_ret = [[sum(r[i][s] * m[i][s] for s in range(t, len(r[i]))) for t in range(len(r[i]))] for i in range(len(r))]
    ref_adv = [[ref_ret[i][t] - float(baselines[i]) * m[i][t] for t in range(len(r[i]))] for i in range(len(r))]
    check(ret, ref_ret, dtype)
    check(adv, ref_adv, dtype)


def test_grpo_singleton_and_tied_groups():
    """A lone response keeps score / (1 + eps); a group of equal scores gets exactly 0."""
    rewards = torch.tensor([[0.0, 2.0], [1.0, 0.0], [1.0, 0.0], [0.0, 3.0], [5.0, 0.0]])
    mask = torch.ones(5, 2)
    uid = np.array(["a", "b", "b", "c", "c"], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, uid)
    assert adv[0, 0].item() == pytest.approx(2.0 / (1 + 1e-6), rel=1e-7)
    assert torch.equal(adv[1:3], torch.zeros(2, 2))
    std = math.sqrt(2.0)  # scores 3 and 5
    assert adv[3, 0].item() == pytest.approx(-1.0 / (std + 1e-6), rel=1e-6)


def test_index_may_be_ints_or_tensor():
    b = make_batch(9, torch.float64)
    codes = {u: k for k, u in enumerate(sorted(set(b["uid"])))}
    as_int = np.array([codes[u] for u in b["uid"]])
    ref, _ = compute_grpo_outcome_advantage(b["outcome"], b["mask"], b["uid"])
    for index in (as_int, torch.tensor(as_int)):
        out, _ = compute_grpo_outcome_advantage(b["outcome"], b["mask"], index)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-15)


# ----------------------------------------------------------------------------- registry and driver
def test_registry_names_and_custom_estimator():
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo"):
        assert name in ADV_ESTIMATORS
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        get_adv_estimator_fn("nope")

    @register_adv_est("test_constant")
    def constant(token_level_rewards, response_mask, **kwargs):
        return response_mask * 2.0, response_mask * 3.0

    try:
        b = make_batch(10, torch.float32)
        data = DataProto.from_dict(tensors={"token_level_rewards": b["outcome"], "response_mask": b["mask"]})
        compute_advantage(data, "test_constant")
        assert torch.equal(data.batch["advantages"], b["mask"] * 2.0)
        assert torch.equal(data.batch["returns"], b["mask"] * 3.0)
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est("test_constant")(lambda **kw: None)
    finally:
        ADV_ESTIMATORS.pop("test_constant")


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                  "remax", "opo"])
def test_compute_advantage_driver_matches_direct_call(name):
    b = make_batch(11, torch.float32)
    mask = b["mask"].clone()
    mask[:, 0] = 1
    baselines = torch.rand(13)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": b["outcome"], "response_mask": mask, "values": b["values"],
                 "reward_baselines": baselines},
        non_tensors={"uid": b["uid"]})
    compute_advantage(data, name, gamma=0.99, lam=0.95, norm_adv_by_std_in_grpo=True)
    direct = {
        "gae": lambda: compute_gae_advantage_return(b["outcome"], b["values"], mask, 0.99, 0.95),
        "grpo": lambda: compute_grpo_outcome_advantage(b["outcome"], mask, b["uid"]),
        "rloo": lambda: compute_rloo_outcome_advantage(b["outcome"], mask, b["uid"]),
        "reinforce_plus_plus": lambda: compute_reinforce_plus_plus_outcome_advantage(b["outcome"], mask, gamma=0.99),
        "reinforce_plus_plus_baseline": lambda: compute_reinforce_plus_plus_baseline_outcome_advantage(
            b["outcome"], mask, b["uid"]),
        "remax": lambda: compute_remax_outcome_advantage(b["outcome"], baselines, mask),
        "opo": lambda: compute_opo_outcome_advantage(b["outcome"], mask, b["uid"]),
    }[name]()
    torch.testing.assert_close(data.batch["advantages"], direct[0], rtol=0, atol=0)
    torch.testing.assert_close(data.batch["returns"], direct[1], rtol=0, atol=0)


def test_compute_advantage_names_missing_inputs():
    b = make_batch(12, torch.float32)
    data = DataProto.from_dict(tensors={"token_level_rewards": b["outcome"], "response_mask": b["mask"]})
    with pytest.raises(ValueError, match="values"):
        compute_advantage(data, "gae")
    with pytest.raises(ValueError, match="uid"):
        compute_advantage(data, "grpo")
    with pytest.raises(ValueError, match="token_level_rewards"):
        compute_advantage(DataProto.from_dict(tensors={"response_mask": b["mask"]}), "grpo")


def test_compute_advantage_derives_response_mask():
    b = make_batch(13, torch.float32)
    prompt = torch.ones(13, 4, dtype=torch.long)
    attention = torch.cat([prompt, b["mask"].long()], dim=1)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": b["outcome"], "responses": torch.zeros(13, 17, dtype=torch.long),
                 "attention_mask": attention},
        non_tensors={"uid": b["uid"]})
    compute_advantage(data, "grpo")
    ref, _ = compute_grpo_outcome_advantage(b["outcome"], b["mask"], b["uid"])
    torch.testing.assert_close(data.batch["advantages"], ref, rtol=0, atol=0)
