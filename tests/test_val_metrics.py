"""Validation metrics (tinyzero.trainer.val_metrics) against a plain-loop reference of veRL's process_validation_metrics.

The reference below is written as veRL's rules read: per data_source and prompt, np.random.seed(seed) before
every draw of (1000, n) indices with replacement, one Python call per draw (max, min, or a dict vote whose ties
go to the pred drawn first, valued at its first draw), the mean and population std over the draws, then the
mean over the prompts. Equality is exact up to float summation order (rel 1e-12).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import numpy as np
import pytest

from tinyzero.trainer.val_metrics import process_validation_metrics, subset_sizes, validation_metrics


def _ref_bootstrap(data: list, n: int, reduce, seed: int) -> tuple[float, float]:
    np.random.seed(seed)
    idx = np.random.choice(len(data), size=(1000, n), replace=True)
    results = []
    for row in idx:
        results.append(float(reduce([data[j] for j in row])))
    mean = sum(results) / len(results)
    return mean, math.sqrt(sum((r - mean) ** 2 for r in results) / len(results))


def _ref_vote(pairs: list) -> float:
    counts, first_val = {}, {}
    for pred, val in pairs:
        counts[pred] = counts.get(pred, 0) + 1
        first_val.setdefault(pred, val)
    best = None
    for pred, c in counts.items():  # insertion order: the first drawn wins a tie
        if best is None or c > counts[best]:
            best = pred
    return first_val[best]


def _ref_sizes(num: int) -> list[int]:
    sizes, n = [], 2
    while n < num:
        sizes.append(n)
        n *= 2
    return sizes + [num] if num > 1 else []


def reference(data_sources, uids, infos, seed=42):
    groups = defaultdict(lambda: defaultdict(list))
    for i, (ds, uid) in enumerate(zip(data_sources, uids)):
        groups[ds][uid].append(i)
    collected = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for ds, by_uid in groups.items():
        for rows in by_uid.values():
            for name, column in infos.items():
                vals = [column[i] for i in rows]
                if isinstance(vals[0], str):
                    continue
                vals = [float(v) for v in vals]
                num = len(vals)
                m = {f"mean@{num}": sum(vals) / num}
                if num > 1:
                    mu = m[f"mean@{num}"]
                    m[f"std@{num}"] = math.sqrt(sum((v - mu) ** 2 for v in vals) / num)
                    for n in _ref_sizes(num):
                        m[f"best@{n}/mean"], m[f"best@{n}/std"] = _ref_bootstrap(vals, n, max, seed)
                        m[f"worst@{n}/mean"], m[f"worst@{n}/std"] = _ref_bootstrap(vals, n, min, seed)
                        if "pred" in infos:
                            pairs = list(zip([infos["pred"][i] for i in rows], vals))
                            m[f"maj@{n}/mean"], m[f"maj@{n}/std"] = _ref_bootstrap(pairs, n, _ref_vote, seed)
                for k, v in m.items():
                    collected[ds][name][k].append(v)
    return {ds: {name: {k: sum(v) / len(v) for k, v in ms.items()} for name, ms in bv.items()}
            for ds, bv in collected.items()}


def _assert_same(got, want):
    assert set(got) == set(want)
    for ds in want:
        assert set(got[ds]) == set(want[ds]), ds
        for name in want[ds]:
            assert set(got[ds][name]) == set(want[ds][name]), (ds, name)
            for k, v in want[ds][name].items():
                assert got[ds][name][k] == pytest.approx(v, rel=1e-12, abs=1e-12), (ds, name, k)


def _make(n_prompts: int, n: int, num_preds: int, rng: random.Random):
    data_sources, uids, reward, acc, pred = [], [], [], [], []
    for p in range(n_prompts):
        ds = "gsm8k" if p % 3 else "math"
        for _ in range(n):
            data_sources.append(ds)
            uids.append(f"u{p}")
            guess = rng.randrange(num_preds)  # few distinct preds: many ties in the vote
            acc.append(guess == 0)
            reward.append(1.0 if guess == 0 else rng.choice([-1.0, 0.0, 0.5]))
            pred.append(str(guess))
    return data_sources, uids, {"reward": reward, "acc": acc, "pred": pred}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_matches_reference_loop(n):
    rng = random.Random(n)
    data_sources, uids, infos = _make(n_prompts=5, n=n, num_preds=3, rng=rng)
    _assert_same(process_validation_metrics(data_sources, uids, infos), reference(data_sources, uids, infos))


def test_matches_reference_other_seed_and_without_pred():
    rng = random.Random(7)
    data_sources, uids, infos = _make(n_prompts=4, n=6, num_preds=2, rng=rng)
    del infos["pred"]
    got = process_validation_metrics(data_sources, uids, infos, seed=123)
    _assert_same(got, reference(data_sources, uids, infos, seed=123))
    assert not any(k.startswith("maj@") for k in got["gsm8k"]["reward"])
    assert got != process_validation_metrics(data_sources, uids, infos, seed=42)


def test_ties_go_to_the_pred_drawn_first():
    # Two responses with different preds: every draw of 2 is a tie or a single pred, so maj@2 is the value of
    # the first drawn response, whatever the second.
    vals, preds = [1.0, 0.0], ["a", "b"]
    got = process_validation_metrics(["d", "d"], ["u", "u"], {"reward": vals, "pred": preds})["d"]["reward"]
    np.random.seed(42)
    first = np.random.choice(2, size=(1000, 2), replace=True)[:, 0]
    assert got["maj@2/mean"] == pytest.approx(float(np.mean([vals[j] for j in first])), rel=1e-12)
    assert got["maj@2/std"] == pytest.approx(float(np.std([vals[j] for j in first])), rel=1e-12)


def test_hand_computed_values():
    # One prompt, four responses, one correct: mean@4 = 0.25, std@4 = sqrt(3)/4; best@4 draws 4 of them with
    # replacement, so its expectation is 1 - (3/4)^4 = 0.684, the worst is 0 in nearly every draw
    # (expectation 1 - ... : P(all four correct) = 1/256). The bootstrap of 1000 draws has a standard error of
    # about 0.015 on best@4/mean: 0.06 is four of them.
    infos = {"reward": [0.0, 0.0, 1.0, 0.0], "acc": [False, False, True, False], "pred": ["7", "7", "8", "7"]}
    m = process_validation_metrics(["d"] * 4, ["u"] * 4, infos)["d"]
    assert m["acc"]["mean@4"] == 0.25 and m["acc"]["std@4"] == pytest.approx(math.sqrt(3) / 4)
    assert m["acc"]["best@4/mean"] == pytest.approx(1 - 0.75 ** 4, abs=0.06)
    assert m["acc"]["worst@4/mean"] == pytest.approx(1 / 256, abs=0.02)
    assert m["acc"]["best@2/mean"] == pytest.approx(1 - 0.75 ** 2, abs=0.06)
    # maj@4 is wrong unless "8" is drawn at least twice and "7" no more than "8" (and first on a 2-2 tie).
    assert m["acc"]["maj@4/mean"] < m["acc"]["best@4/mean"]
    assert "pred" not in m  # a string variable gets no metrics
    # Two prompts average: a constant prompt has best = worst = mean and std 0.
    m2 = process_validation_metrics(["d"] * 8, ["u"] * 4 + ["v"] * 4,
                                    {"reward": infos["reward"] + [1.0] * 4})["d"]["reward"]
    single = process_validation_metrics(["d"] * 4, ["u"] * 4, {"reward": infos["reward"]})["d"]["reward"]
    assert m2["mean@4"] == pytest.approx((0.25 + 1.0) / 2)
    assert m2["best@4/mean"] == pytest.approx((single["best@4/mean"] + 1.0) / 2, rel=1e-12)
    assert m2["worst@4/std"] == pytest.approx(single["worst@4/std"] / 2, rel=1e-12)


def test_core_and_aux_names():
    rng = random.Random(3)
    data_sources, uids, infos = _make(n_prompts=3, n=4, num_preds=3, rng=rng)
    flat = validation_metrics(data_sources, uids, infos)
    nested = process_validation_metrics(data_sources, uids, infos)
    core = sorted(k for k in flat if k.startswith("val-core/"))
    assert core == sorted(f"val-core/{ds}/acc/{m}" for ds in ("gsm8k", "math")
                          for m in ("mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std"))
    assert flat["val-aux/gsm8k/reward/mean@4"] == nested["gsm8k"]["reward"]["mean@4"]
    assert flat["val-aux/math/acc/best@2/mean"] == nested["math"]["acc"]["best@2/mean"]
    assert "val-aux/gsm8k/acc/std@4" in flat and "val-aux/gsm8k/acc/worst@4/mean" in flat
    assert len(flat) == sum(len(m) for by_var in nested.values() for m in by_var.values())
    # Without acc the core variable is the reward; greedy validation (N = 1) has mean@1 only.
    greedy = validation_metrics(["a", "a", "b"], ["0", "1", "2"], {"reward": [1.0, 0.0, 0.5]})
    assert greedy == {"val-core/a/reward/mean@1": 0.5, "val-core/b/reward/mean@1": 0.5}


def test_missing_values_and_bad_lengths():
    # A key a scorer returned for some responses only: the prompts holding a None are left out for it.
    infos = {"reward": [1.0, 0.0, 1.0, 1.0], "extra": [0.5, None, 2.0, 4.0]}
    m = process_validation_metrics(["d"] * 4, ["u", "u", "v", "v"], infos)["d"]
    assert m["extra"]["mean@2"] == 3.0 and m["reward"]["mean@2"] == 0.75
    with pytest.raises(ValueError, match="'extra' has 3 values for 4 responses"):
        process_validation_metrics(["d"] * 4, ["u"] * 4, {"reward": [1.0] * 4, "extra": [1, 2, 3]})


def test_subset_sizes():
    assert subset_sizes(1) == [] and subset_sizes(2) == [2] and subset_sizes(5) == [2, 4, 5]
    assert subset_sizes(8) == [2, 4, 8] and subset_sizes(16) == [2, 4, 8, 16]


def test_global_random_state_untouched():
    np.random.seed(5)
    expected = np.random.rand()
    np.random.seed(5)
    process_validation_metrics(["d"] * 4, ["u"] * 4, {"reward": [0.0, 1.0, 1.0, 0.0], "pred": list("abab")})
    assert np.random.rand() == expected


# ---------------------------------------------------------------------------------------------- through the trainer
REWARD = '''
"""Test reward: exact "a+b=" scoring; a dict result with the answer as `pred`."""


def score(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str.strip() == str(ground_truth)
    return {"score": 1.0 if right else 0.0, "acc": right, "pred": solution_str.strip()}
'''


def _flatten(nested: dict) -> dict:
    """veRL's val-core / val-aux split, written out."""
    out = {}
    for ds, by_var in nested.items():
        core_var = "acc" if "acc" in by_var else "reward"
        for name, metrics in by_var.items():
            n_max = max(int(k.split("@")[-1].split("/")[0]) for k in metrics)
            for k, v in metrics.items():
                core = name == core_var and k.split("@")[0] in ("mean", "maj", "best") and f"@{n_max}" in k
                out[f"{'val-core' if core else 'val-aux'}/{ds}/{name}/{k}"] = v
    return out


def _read_jsonl(path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_trainer_dumps_and_logs_verl_validation_metrics(tmp_path, tiny_model_dir):
    """2 GRPO steps on 2 CPU ranks with 4 sampled validation responses per prompt: the rollout and validation dumps
    hold every response with the score the reward rule gives it, and the logged val-core / val-aux metrics are
    the plain-loop reference's over the dumped responses."""
    import os
    import subprocess
    import sys

    import pyarrow.parquet as pq

    from tinyzero.demo import build_data
    from tinyzero.trainer.loggers import read_metrics

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    build_data(str(tmp_path / "data"))
    (tmp_path / "reward.py").write_text(REWARD)
    run, rollout_dir, val_dir = tmp_path / "run", tmp_path / "rollouts", tmp_path / "val"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(root, "train.py"), "--preset", "demo_cpu", f"--data.train_files={tmp_path}/data/train.parquet",
           f"--data.val_files={tmp_path}/data/test.parquet", f"--actor_rollout_ref.model.path={tiny_model_dir}",
           f"--trainer.default_local_dir={run}", f"--reward.custom_fn={tmp_path}/reward.py:score",
           "--data.train_batch_size=8", "--actor_rollout_ref.rollout.n=2", "--trainer.total_training_steps=2",
           "--actor_rollout_ref.rollout.val_kwargs.n=4", "--actor_rollout_ref.rollout.val_kwargs.do_sample=true",
           "--actor_rollout_ref.rollout.val_kwargs.temperature=1.0", f"--trainer.rollout_data_dir={rollout_dir}",
           f"--trainer.validation_data_dir={val_dir}", "--trainer.plot=false", "--trainer.progress_bar=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = {r["step"]: r for r in read_metrics(str(run))}
    num_val = pq.read_table(f"{tmp_path}/data/test.parquet").num_rows

    assert sorted(p.name for p in rollout_dir.iterdir()) == ["1.jsonl", "2.jsonl"]
    for step in (1, 2):
        lines = _read_jsonl(rollout_dir / f"{step}.jsonl")
        assert len(lines) == 16
        for line in lines:
            assert set(line) == {"input", "output", "gts", "score", "step", "acc", "pred"}, line
            assert line["step"] == step and line["input"].endswith("=")
            right = line["output"].strip() == str(line["gts"])
            assert line["score"] == (1.0 if right else 0.0) and line["acc"] is right, line
            assert line["pred"] == line["output"].strip()
        for key in ("response/aborted_ratio", "response_length_non_aborted/mean", "response_length/mean"):
            assert key in rows[step], (key, sorted(rows[step]))

    assert sorted(p.name for p in val_dir.iterdir()) == ["0.jsonl", "2.jsonl"]
    fields = {"input", "output", "gts", "step"}  # the rest are the variables: reward and the scorer's keys
    for step in (0, 2):
        lines = _read_jsonl(val_dir / f"{step}.jsonl")
        assert len(lines) == 4 * num_val
        for i, line in enumerate(lines):
            assert set(line) == fields | {"score", "reward", "acc", "pred"}, line
            assert line["step"] == step and line["input"] == lines[i - i % 4]["input"]  # a prompt's 4 responses
            assert line["score"] == line["reward"] == (1.0 if line["output"].strip() == str(line["gts"]) else 0.0)
        infos = {k: [line[k] for line in lines] for k in lines[0] if k not in fields}
        want = _flatten(reference(["arithmetic"] * len(lines), [i // 4 for i in range(len(lines))], infos))
        got = {k: v for k, v in rows[step].items() if k.startswith(("val-core/", "val-aux/"))}
        assert set(got) == set(want)
        assert {"val-core/arithmetic/acc/best@4/mean", "val-core/arithmetic/acc/maj@4/mean",
                "val-aux/arithmetic/reward/mean@4", "val-aux/arithmetic/score/worst@2/std"} <= set(got)
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-12), k
