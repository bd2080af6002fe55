"""Losses, KL estimators / controllers, in-reward KL, TIS and configs against float64 references.

References are scalar Python loops over tokens restating veRL's formulas (core_algos.py);
inputs are random with right-padded masks including empty and one-token responses.
Tolerance: 1e-6 (float64 inputs) / 1e-5 (float32), absolute and relative.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tinyzero.algorithms import (
    POLICY_LOSSES,
    AdaptiveKLController,
    AlgorithmConfig,
    FixedKLController,
    KLControlConfig,
    agg_loss,
    apply_kl_penalty,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
    get_kl_controller,
    get_policy_loss_fn,
    kl_penalty,
    masked_mean,
    register_policy_loss,
    rollout_mismatch_metrics,
    tis_weights,
)
from tinyzero.protocol import DataProto

TOL = {torch.float64: 1e-6, torch.float32: 1e-5}
DTYPES = [torch.float64, torch.float32]


class ActorCfg:
    """The clip fields an actor config carries."""

    def __init__(self, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                 tis_imp_ratio_cap=-1.0):
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = clip_ratio, clip_ratio_low, clip_ratio_high
        self.clip_ratio_c, self.tis_imp_ratio_cap = clip_ratio_c, tis_imp_ratio_cap


def make(seed: int, dtype: torch.dtype, batch: int = 9, length: int = 11):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=g)
    lengths[0], lengths[1], lengths[2] = 0, 1, length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(dtype)

    def rnd(scale=1.0):
        return (torch.randn(batch, length, generator=g, dtype=torch.float64) * scale).to(dtype)

    old = rnd() - 2.0
    return dict(mask=mask, old=old, new=old + rnd(0.3), adv=rnd(), ref=old + rnd(0.5), rollout=old + rnd(0.2),
                values=rnd(), vpreds=rnd(), returns=rnd())


def ref_agg(loss, mask, mode):
    rows = len(loss)
    if mode == "token-mean":
        return sum(x * m for rl, rm in zip(loss, mask) for x, m in zip(rl, rm)) / sum(sum(rm) for rm in mask)
    sums = [sum(x * m for x, m in zip(rl, rm)) for rl, rm in zip(loss, mask)]
    counts = [sum(rm) for rm in mask]
    nonempty = [i for i in range(rows) if counts[i] > 0]
    if mode == "seq-mean-token-sum":
        return sum(sums[i] for i in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sums[i] / (counts[i] + 1e-8) for i in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum-norm":
        return sum(sums) / len(mask[0])
    raise AssertionError(mode)


def ref_mean(x, mask):
    return sum(a * m for ra, rm in zip(x, mask) for a, m in zip(ra, rm)) / (sum(sum(r) for r in mask) + 1e-8)


def close(out, ref, dtype):
    assert torch.isfinite(torch.as_tensor(out)).all()
    torch.testing.assert_close(torch.as_tensor(out).double(), torch.as_tensor(ref, dtype=torch.float64),
                               rtol=TOL[dtype], atol=TOL[dtype])


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_modes(dtype, mode):
    b = make(0, dtype)
    close(agg_loss(b["adv"], b["mask"], mode), ref_agg(b["adv"].tolist(), b["mask"].tolist(), mode), dtype)


def test_agg_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "mean")


def ref_ppo(old, new, adv, mask, low, high, c, mode, tis_cap=None, rollout=None):
    losses, clipped, lower, negkl = [], [], [], []
    for i in range(len(old)):
        rl, rc, rlow, rk = [], [], [], []
        for t in range(len(old[i])):
            nk = min(max(new[i][t] - old[i][t], -20.0), 20.0)
            ratio = math.exp(nk)
            a = adv[i][t]
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
            c1 = max(l1, l2)
            loss = min(-a * c, c1) if a < 0 else c1
            if tis_cap is not None:
                loss *= min(math.exp(old[i][t] - rollout[i][t]), tis_cap)
            rl.append(loss)
            rc.append(float(l2 > l1))
            rlow.append(float(c1 > -a * c and a < 0))
            rk.append(-nk)
        losses.append(rl)
        clipped.append(rc)
        lower.append(rlow)
        negkl.append(rk)
    return ref_agg(losses, mask, mode), ref_mean(clipped, mask), ref_mean(negkl, mask), ref_mean(lower, mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.2, 0.28)])
def test_vanilla_ppo_loss_matches_reference(dtype, mode, low, high):
    b = make(1, dtype)
    cfg = ActorCfg(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0)
    out = get_policy_loss_fn("vanilla")(b["old"], b["new"], b["adv"], b["mask"], mode, cfg)
    ref = ref_ppo(b["old"].tolist(), b["new"].tolist(), b["adv"].tolist(), b["mask"].tolist(), low, high, 3.0, mode)
    for o, r in zip(out, ref):
        close(o, r, dtype)
    legacy = compute_policy_loss(b["old"], b["new"], b["adv"], b["mask"], 0.2, low, high, 3.0, mode)
    for o, r in zip(legacy, ref):
        close(o, r, dtype)


def test_vanilla_ppo_clip_fractions_are_exercised():
    b = make(2, torch.float64)
    new = b["old"] + 2.0 * torch.sign(torch.randn_like(b["old"]))  # ratios far outside the clip range
    _, clipfrac, _, lower = compute_policy_loss(b["old"], new, b["adv"], b["mask"], 0.2)
    assert 0.1 < clipfrac.item() < 0.9
    assert lower.item() > 0.05
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(b["old"], new, b["adv"], b["mask"], 0.2, clip_ratio_c=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tis_weights_the_policy_loss(dtype):
    b = make(3, dtype)
    cfg = ActorCfg(tis_imp_ratio_cap=1.1)
    out = get_policy_loss_fn("vanilla")(b["old"], b["new"], b["adv"], b["mask"], "token-mean", cfg, b["rollout"])
    ref = ref_ppo(b["old"].tolist(), b["new"].tolist(), b["adv"].tolist(), b["mask"].tolist(), 0.2, 0.2, 3.0,
                  "token-mean", tis_cap=1.1, rollout=b["rollout"].tolist())
    close(out[0], ref[0], dtype)
    off = get_policy_loss_fn("vanilla")(b["old"], b["new"], b["adv"], b["mask"], "token-mean", ActorCfg(),
                                        b["rollout"])
    plain = get_policy_loss_fn("vanilla")(b["old"], b["new"], b["adv"], b["mask"], "token-mean", ActorCfg())
    assert torch.equal(off[0], plain[0]), "TIS is off by default"
    w = tis_weights(b["old"], b["rollout"], b["mask"], 1.1)
    assert (w <= torch.tensor(1.1, dtype=dtype)).all() and torch.equal(w * (1 - b["mask"]), torch.zeros_like(w))
    expect = torch.clamp(torch.exp(b["old"].double() - b["rollout"].double()), max=1.1) * b["mask"].double()
    close(w, expect, dtype)


def test_tis_gradient_flows_only_through_the_ratio():
    b = make(4, torch.float64)
    new = b["new"].clone().requires_grad_(True)
    cfg = ActorCfg(tis_imp_ratio_cap=2.0)
    loss = get_policy_loss_fn("vanilla")(b["old"], new, b["adv"], b["mask"], "token-mean", cfg, b["rollout"])[0]
    loss.backward()
    weight = torch.clamp(torch.exp(b["old"] - b["rollout"]), max=2.0)
    new2 = b["new"].clone().requires_grad_(True)
    ratio = torch.exp(new2 - b["old"])
    l1, l2 = -b["adv"] * ratio, -b["adv"] * ratio.clamp(0.8, 1.2)
    c1 = torch.maximum(l1, l2)
    per_token = torch.where(b["adv"] < 0, torch.minimum(-b["adv"] * 3.0, c1), c1) * weight
    ((per_token * b["mask"]).sum() / b["mask"].sum()).backward()
    torch.testing.assert_close(new.grad, new2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gspo_matches_reference(dtype):
    b = make(5, dtype)
    cfg = ActorCfg(clip_ratio=0.0003, clip_ratio_low=0.0003, clip_ratio_high=0.0004)
    loss, clipfrac, ppo_kl, lower = get_policy_loss_fn("gspo")(b["old"], b["new"], b["adv"], b["mask"],
                                                               "token-mean", cfg)
    old, new, adv, mask = b["old"].tolist(), b["new"].tolist(), b["adv"].tolist(), b["mask"].tolist()
    losses, clipped = [], []
    for i in range(len(old)):
        n = max(sum(mask[i]), 1)
        seq = sum((new[i][t] - old[i][t]) * mask[i][t] for t in range(len(old[i]))) / n
        ratio = math.exp(min(seq, 10.0))
        l1 = [-a * ratio for a in adv[i]]
        l2 = [-a * min(max(ratio, 1 - 0.0003), 1 + 0.0004) for a in adv[i]]
        losses.append([max(x, y) for x, y in zip(l1, l2)])
        clipped.append([float(y > x) for x, y in zip(l1, l2)])
    close(loss, ref_agg(losses, mask, "seq-mean-token-mean"), dtype)
    close(clipfrac, ref_mean(clipped, mask), dtype)
    close(ppo_kl, ref_mean([[o - nn for o, nn in zip(ro, rn)] for ro, rn in zip(old, new)], mask), dtype)
    assert lower.item() == 0.0


def test_policy_loss_registry():
    assert {"vanilla", "gspo"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="unknown policy loss"):
        get_policy_loss_fn("nope")

    @register_policy_loss("test_pg")
    def plain_pg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                 rollout_log_probs=None):
        loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode)
        zero = torch.zeros(())
        return loss, zero, zero, zero

    try:
        b = make(6, torch.float64)
        assert get_policy_loss_fn("test_pg")(b["old"], b["new"], b["adv"], b["mask"])[0].isfinite()
    finally:
        POLICY_LOSSES.pop("test_pg")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_reference(dtype, mode):
    b = make(7, dtype)
    eps = 0.5
    vf_loss, vf_clipfrac = compute_value_loss(b["vpreds"], b["returns"], b["values"], b["mask"], eps, mode)
    vp, rt, vv, mask = b["vpreds"].tolist(), b["returns"].tolist(), b["values"].tolist(), b["mask"].tolist()
    losses, clipped = [], []
    for i in range(len(vp)):
        rl, rc = [], []
        for t in range(len(vp[i])):
            vc = min(max(vp[i][t], vv[i][t] - eps), vv[i][t] + eps)
            l1, l2 = (vp[i][t] - rt[i][t]) ** 2, (vc - rt[i][t]) ** 2
            rl.append(max(l1, l2))
            rc.append(float(l2 > l1))
        losses.append(rl)
        clipped.append(rc)
    close(vf_loss, 0.5 * ref_agg(losses, mask, mode), dtype)
    close(vf_clipfrac, ref_mean(clipped, mask), dtype)


def ref_kl(lp, ref, kind):
    d = lp - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    x = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_estimators(dtype, kind):
    b = make(8, dtype)
    ref = b["ref"].clone()
    ref[0, :3] = b["old"][0, :3] + torch.tensor([30.0, -30.0, 12.0], dtype=dtype)  # exercise both clamps
    out = kl_penalty(b["old"], ref, kind)
    expect = [[ref_kl(a, c, kind) for a, c in zip(ra, rc)] for ra, rc in zip(b["old"].tolist(), ref.tolist())]
    close(out, expect, dtype)


def test_kl_straight_through_and_full():
    b = make(9, torch.float64)
    lp = b["old"].clone().requires_grad_(True)
    out = kl_penalty(lp, b["ref"], "k3+")
    torch.testing.assert_close(out, kl_penalty(b["old"], b["ref"], "k3"))
    out.sum().backward()
    torch.testing.assert_close(lp.grad, b["old"] - b["ref"])  # the k2 gradient
    with pytest.raises(ValueError, match="full"):
        kl_penalty(b["old"], b["ref"], "full")
    with pytest.raises(ValueError, match="unknown kl_penalty"):
        kl_penalty(b["old"], b["ref"], "k9")


def test_kl_loss_term():
    b = make(10, torch.float64)
    out = compute_kl_loss(b["old"], b["ref"], b["mask"], "low_var_kl", "token-mean")
    expect = [[ref_kl(a, c, "k3") for a, c in zip(ra, rc)] for ra, rc in zip(b["old"].tolist(), b["ref"].tolist())]
    close(out, ref_agg(expect, b["mask"].tolist(), "token-mean"), torch.float64)


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(10.0, 100)
    assert fixed.value == 0.05
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.02, horizon=1000)
    value = 0.1
    for kl, n in [(0.05, 64), (0.0, 64), (0.021, 32), (1e-4, 128)]:
        ctrl.update(kl, n)
        value *= 1 + min(max(kl / 0.02 - 1, -0.2), 0.2) * n / 1000
        assert ctrl.value == pytest.approx(value, rel=1e-12)
    assert isinstance(get_kl_controller(KLControlConfig(type="fixed", kl_coef=0.2)), FixedKLController)
    adaptive = get_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.1, horizon=5))
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.horizon == 5


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
def test_apply_kl_penalty(kind):
    b = make(11, torch.float32)
    scores = torch.zeros_like(b["old"])
    scores[:, 0] = 1.0
    data = DataProto.from_dict(tensors={"old_log_probs": b["old"], "ref_log_prob": b["ref"],
                                        "token_level_scores": scores, "response_mask": b["mask"]})
    ctrl = AdaptiveKLController(0.1, 0.01, 100)
    data, metrics = apply_kl_penalty(data, ctrl, kind)
    mask = b["mask"].tolist()
    kld = [[ref_kl(a, c, kind) * m for a, c, m in zip(ra, rc, rm)]
           for ra, rc, rm in zip(b["old"].tolist(), b["ref"].tolist(), mask)]
    expect = [[s - 0.1 * k for s, k in zip(rs, rk)] for rs, rk in zip(scores.tolist(), kld)]
    close(data.batch["token_level_rewards"], expect, torch.float32)
    per_seq = [sum(rk) / (sum(rm) + 1e-8) for rk, rm in zip(kld, mask)]
    current = sum(per_seq) / len(per_seq)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current, rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    assert ctrl.value == pytest.approx(0.1 * (1 + float(np.clip(current / 0.01 - 1, -0.2, 0.2)) * 9 / 100), rel=1e-6)
    with pytest.raises(ValueError, match="ref_log_prob"):
        apply_kl_penalty(DataProto.from_dict(tensors={"old_log_probs": b["old"]}), ctrl, kind)


def test_entropy_loss_matches_reference():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(3, 4, 7, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    out = compute_entropy_loss(logits, mask)
    p = torch.softmax(logits, -1)
    ent = -(p * torch.log(p)).sum(-1)
    close(out, (ent * mask).sum() / mask.sum(), torch.float32)


def test_rollout_mismatch_metrics():
    b = make(13, torch.float64)
    m = rollout_mismatch_metrics(b["old"], b["rollout"], b["mask"], tis_cap=1.1)
    valid = b["mask"].bool()
    diff = (b["old"].exp() - b["rollout"].exp()).abs()[valid]
    assert m["training/rollout_probs_diff_max"].item() == pytest.approx(diff.max().item())
    assert m["training/rollout_probs_diff_mean"].item() == pytest.approx(diff.mean().item())
    assert m["training/rollout_probs_diff_std"].item() == pytest.approx(diff.std().item())
    assert m["rollout_corr/kl"].item() == pytest.approx(masked_mean(b["rollout"] - b["old"], b["mask"]).item())
    ratio = (b["old"] - b["rollout"]).exp()
    assert m["training/rollout_tis_clip_frac"].item() == pytest.approx(
        ((ratio > 1.1).double() * b["mask"]).sum().item() / b["mask"].sum().item(), rel=1e-6)
    log_diff = (b["old"] - b["rollout"]).abs()[valid]
    assert m["training/rollout_log_probs_diff_mean"].item() == pytest.approx(log_diff.mean().item())
    k3 = (ratio - (b["old"] - b["rollout"]) - 1)[valid]
    assert m["rollout_corr/k3_kl"].item() == pytest.approx(k3.mean().item())
    # veRL's per-sequence off-policy metrics, as a Python loop over rows (masked means divide by count + 1e-8).
    rows = b["mask"].shape[0]
    tr, ro, lr_seq = [], [], []
    for i in range(rows):
        idx = [t for t in range(b["mask"].shape[1]) if b["mask"][i, t]]
        count = len(idx) + 1e-8
        tr.append(sum(float(b["old"][i, t]) for t in idx) / count)
        ro.append(sum(float(b["rollout"][i, t]) for t in idx) / count)
        lr_seq.append(sum(float(b["old"][i, t] - b["rollout"][i, t]) for t in idx))
    diffs = [r - t for r, t in zip(ro, tr)]
    want = {"training_ppl": sum(math.exp(-t) for t in tr) / rows, "training_log_ppl": -sum(tr) / rows,
            "rollout_ppl": sum(math.exp(-r) for r in ro) / rows, "rollout_log_ppl": -sum(ro) / rows,
            "log_ppl_diff": sum(diffs) / rows, "log_ppl_abs_diff": sum(abs(d) for d in diffs) / rows,
            "log_ppl_diff_max": max(diffs), "log_ppl_diff_min": min(diffs),
            "ppl_ratio": sum(math.exp(d) for d in diffs) / rows,
            "chi2_token": float((ratio ** 2)[valid].sum()) / (int(valid.sum()) + 1e-8) - 1.0,
            "chi2_seq": sum(math.exp(2 * min(max(x, -20.0), 20.0)) for x in lr_seq) / rows - 1.0}
    for k, v in want.items():
        assert m[f"rollout_corr/{k}"].item() == pytest.approx(v, rel=1e-9, abs=1e-12), k
    pt, pr = b["old"].exp()[valid].tolist(), b["rollout"].exp()[valid].tolist()
    mt, mr = sum(pt) / len(pt), sum(pr) / len(pr)
    cov = sum((x - mt) * (y - mr) for x, y in zip(pt, pr))
    corr = cov / math.sqrt(sum((x - mt) ** 2 for x in pt) * sum((y - mr) ** 2 for y in pr))
    assert m["training/rollout_actor_probs_pearson_corr"].item() == pytest.approx(corr, rel=1e-9)
    same = rollout_mismatch_metrics(b["old"], b["old"], b["mask"])
    assert same["training/rollout_probs_diff_max"].item() == 0.0 and same["rollout_corr/k3_kl"].item() == 0.0
    count = int(valid.sum())  # r = 1 everywhere: 0 but for masked_mean's + 1e-8
    assert same["rollout_corr/chi2_token"].item() == pytest.approx(count / (count + 1e-8) - 1.0, abs=1e-15)
    half = rollout_mismatch_metrics(b["old"].bfloat16(), b["rollout"].bfloat16(), b["mask"])
    bf = {k: b[k].bfloat16().double() for k in ("old", "rollout")}  # upcast before the maths, not after
    assert half["rollout_corr/kl"].item() == pytest.approx(
        masked_mean(bf["rollout"] - bf["old"], b["mask"]).item(), rel=1e-5)
    empty = rollout_mismatch_metrics(b["old"], b["rollout"], torch.zeros_like(b["mask"]))
    assert all(v.item() == 0.0 for v in empty.values())


def test_data_metrics_log_the_rollout_mismatch():
    from tinyzero.protocol import DataProto
    from tinyzero.trainer.metrics import compute_data_metrics

    b = make(6, torch.float32)
    rows, resp = b["mask"].shape
    data = DataProto.from_dict(tensors={
        "responses": torch.zeros(rows, resp, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(rows, 3, dtype=torch.long), b["mask"].long()], dim=-1),
        "response_mask": b["mask"], "token_level_scores": torch.zeros(rows, resp),
        "old_log_probs": b["old"], "rollout_log_probs": b["rollout"]})
    out = compute_data_metrics(data, use_critic=False, tis_cap=1.1)
    ref = rollout_mismatch_metrics(b["old"], b["rollout"], b["mask"], tis_cap=1.1)
    assert {k: float(v) for k, v in ref.items()} == {k: out[k] for k in ref}
    assert {"rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_seq", "training/rollout_tis_clip_frac"} <= set(out)


def test_algorithm_config_validation():
    cfg = AlgorithmConfig(adv_estimator="grpo", kl_ctrl={"type": "adaptive", "kl_coef": 0.01})
    assert isinstance(cfg.kl_ctrl, KLControlConfig)
    for kwargs, field in [({"gamma": 1.5}, "gamma"), ({"lam": -0.1}, "lam"), ({"adv_estimator": "ppo"}, "adv_estimator"),
                          ({"kl_penalty": "k4"}, "kl_penalty")]:
        with pytest.raises(ValueError, match=field):
            AlgorithmConfig(**kwargs)
    with pytest.raises(ValueError, match="horizon"):
        KLControlConfig(type="adaptive", horizon=0)
    with pytest.raises(ValueError, match="type"):
        KLControlConfig(type="pid")
