"""DAPO: overlong reward shaping and dynamic sampling, against hand-computed cases and through train.py.

Budget: the unit tests take about a second; the two 2-rank runs of train.py with the tiny model
(marked slow) take about a minute together.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.test_e2e_train import ENV, ROOT, _cmd, torchrun
from tests.test_rewards_manager import _batch
from tinyzero.algorithms.config import FilterGroupsConfig
from tinyzero.algorithms.dynamic_sampling import FILTER_METRICS, filter_groups
from tinyzero.cli import load_preset
from tinyzero.config import ConfigError, check_config
from tinyzero.protocol import DataProto
from tinyzero.rewards import RewardConfig, RewardManager
from tinyzero.rewards.config import OverlongBufferConfig
from tinyzero.rewards.overlong import apply_overlong_penalty, overlong_penalty
from tinyzero.trainer.loggers import read_metrics

# ------------------------------------------------------------------ overlong reward shaping


def test_overlong_penalty_hand_computed():
    # M = 10, B = 4, factor 0.5: no penalty up to 6 tokens, then -0.125 per token, -0.5 at 10.
    lengths = torch.tensor([0, 3, 6, 7, 8, 10, 12])
    got = overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=0.5)
    expected = torch.tensor([0.0, 0.0, 0.0, -0.125, -0.25, -0.5, -0.75])  # 12: past the buffer, not clamped
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # A buffer as long as the response: linear from the first token.
    got = overlong_penalty(torch.tensor([1, 2, 4]), max_response_length=4, buffer_len=4, penalty_factor=1.0)
    torch.testing.assert_close(got, torch.tensor([-0.25, -0.5, -1.0]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_penalty(lengths, max_response_length=10, buffer_len=11, penalty_factor=1.0)


def test_overlong_penalty_sits_on_the_last_token():
    scores = torch.zeros(4, 6)
    lengths = torch.tensor([0, 2, 5, 6])
    scores[1, 1], scores[2, 4], scores[3, 5] = 1.0, 0.5, 1.0
    metrics: dict = {}
    cfg = OverlongBufferConfig(enable=True, len=3, penalty_factor=1.5)  # expected_len 3: -0.5 per token past it
    shaped = apply_overlong_penalty(scores, lengths, cfg, metrics)
    expected = scores.clone()
    expected[2, 4] += -1.0   # 5 tokens: 2 past
    expected[3, 5] += -1.5   # 6 tokens: the whole buffer
    torch.testing.assert_close(shaped, expected, rtol=0, atol=0)
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(-2.5 / 4)
    assert metrics["reward/overlong_rate"] == 0.5
    off = apply_overlong_penalty(scores, lengths, OverlongBufferConfig(), {})
    assert off is scores


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_reward_manager_applies_the_penalty(tokenizer):
    samples = [("arithmetic", text, "19", {"answer_format": "plain"}) for text in ("19", "18", "1919", "19191919")]
    batch, lengths = _batch(tokenizer, samples, response_len=8)
    base = RewardManager(tokenizer, RewardConfig(num_workers=0))(batch)
    buffer = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)  # expected_len 4
    out = RewardManager(tokenizer, RewardConfig(num_workers=0, overlong_buffer=buffer))(batch)
    expected = base.token_level_scores.clone()
    for i, n in enumerate(lengths):  # a plain loop of veRL's rule
        expected[i, n - 1] += min(-(n - 4) / 4 * 1.0, 0.0)
    assert lengths == [3, 3, 5, 8]  # byte tokens + eos: below, below, inside and at the end of the buffer
    torch.testing.assert_close(out.token_level_scores, expected, rtol=0, atol=1e-7)
    assert [s["score"] for s in out.samples] == [s["score"] for s in base.samples]  # the scorer's score unshaped
    assert out.metrics["reward/overlong_penalty/mean"] == pytest.approx((-0.25 - 1.0) / 4)


# ------------------------------------------------------------------ the dynamic-sampling filter

# uid, acc, score, token_level_scores sum (score + overlong penalty), token_level_rewards sum
ROWS = [
    ("a", 1, 1.0, 1.0, 0.5), ("a", 1, 1.0, 1.0, 0.5), ("a", 1, 1.0, 0.75, 0.5),
    ("b", 0, 0.1, 0.1, 0.1), ("b", 1, 1.0, 1.0, 1.0), ("b", 0, 0.1, 0.1, 0.1),
    ("c", 0, 0.1, 0.1, 0.1), ("c", 0, 0.1, 0.1, 0.1), ("c", 0, 0.0, 0.0, 0.0),
    ("d", 1, 1.0, 1.0, 1.0),  # a group of one sample is kept (veRL)
    ("e", 0, 0.1, 0.1, 0.1), ("e", 0, 0.1, 0.1, 0.1), ("e", 0, 0.1, 0.1, 0.1),  # np.std of these is 1.4e-17
]
KEPT = {"acc": "bd", "score": "bcd", "seq_reward": "abcd", "seq_final_reward": "bcd"}


def _scored_batch() -> DataProto:
    def at_last_token(values):  # (rows, 3) with the value on the last response token
        t = torch.zeros(len(ROWS), 3, dtype=torch.float32)
        t[:, -1] = torch.tensor(values, dtype=torch.float32)
        return t

    return DataProto.from_dict(
        tensors={"token_level_scores": at_last_token([r[3] for r in ROWS]),
                 "token_level_rewards": at_last_token([r[4] for r in ROWS])},
        non_tensors={"uid": np.array([r[0] for r in ROWS], dtype=object),
                     "acc": np.array([float(r[1]) for r in ROWS]), "score": np.array([r[2] for r in ROWS])})


@pytest.mark.parametrize("metric", sorted(KEPT))
def test_filter_keeps_groups_whose_metric_varies(metric):
    batch = _scored_batch()
    result = filter_groups(batch.non_tensor_batch["uid"], FILTER_METRICS[metric](batch))
    expected_rows = [i for i, r in enumerate(ROWS) if r[0] in KEPT[metric]]
    assert result.rows.tolist() == expected_rows
    assert (result.num_groups, result.num_kept_groups) == (5, len(KEPT[metric]))
    kept = batch.select_idxs(result.rows)
    assert sorted(set(kept.non_tensor_batch["uid"])) == list(KEPT[metric])


def test_filter_metric_needs_the_scorer_values():
    batch = _scored_batch()
    batch.non_tensor_batch.pop("acc")
    with pytest.raises(ValueError, match="metric='acc'.*seq_reward"):
        FILTER_METRICS["acc"](batch)


def test_dapo_config_checks():
    with pytest.raises(ValueError, match="algorithm.filter_groups.metric='bogus'"):
        FilterGroupsConfig(metric="bogus")
    with pytest.raises(ValueError, match="max_num_gen_batches"):
        FilterGroupsConfig(max_num_gen_batches=-1)
    with pytest.raises(ValueError, match="reward.overlong_buffer.len"):
        OverlongBufferConfig(len=0)
    cfg = load_preset("demo_cpu")  # max_response_length 4
    cfg.reward.overlong_buffer = OverlongBufferConfig(enable=True, len=5)
    with pytest.raises(ConfigError, match="overlong_buffer.len=5 exceeds data.max_response_length=4"):
        check_config(cfg)
    cfg = load_preset("demo_cpu")
    cfg.algorithm.filter_groups = FilterGroupsConfig(enable=True, metric="seq_final_reward")
    cfg.algorithm.use_kl_in_reward = True
    with pytest.raises(ConfigError, match="seq_final_reward"):
        check_config(cfg)
    cfg = load_preset("demo_cpu")  # GRPO, n = 8
    cfg.actor_rollout_ref.rollout.do_sample = False
    with pytest.warns(UserWarning, match="do_sample=false with n=8"):
        check_config(cfg)
    cfg.actor_rollout_ref.rollout.do_sample = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_config(cfg)
    cfg.algorithm.adv_estimator = "reinforce_plus_plus"
    cfg.actor_rollout_ref.rollout.n = 1
    cfg.algorithm.filter_groups = FilterGroupsConfig(enable=True)
    with pytest.warns(UserWarning, match="filter_groups.enable=true with actor_rollout_ref.rollout.n=1"):
        check_config(cfg)


# ------------------------------------------------------------------ through train.py on 2 ranks

# Every response scores 1.0, so a trained score is exactly 1 + its overlong penalty; acc varies with the
# text for even answers only, so the filter on acc drops the odd answers' groups (and some even ones).
REWARD = '''
def score(data_source, solution_str, ground_truth, extra_info=None):
    """score 1; acc from the text's parity for even answers, False for odd ones."""
    return {"score": 1.0, "acc": int(ground_truth) % 2 == 0 and sum(map(ord, solution_str)) % 2 == 1}
'''


def _args(tmp_path, tiny_model_dir, run: str, *extra: str) -> list[str]:
    from tinyzero.demo import build_data

    if not (tmp_path / "data").exists():
        build_data(str(tmp_path / "data"))
        (tmp_path / "reward.py").write_text(REWARD)
    return ["--preset", "demo_cpu", f"--data.train_files={tmp_path}/data/train.parquet",
            f"--data.val_files={tmp_path}/data/test.parquet", f"--actor_rollout_ref.model.path={tiny_model_dir}",
            f"--trainer.default_local_dir={tmp_path}/{run}", f"--reward.custom_fn={tmp_path}/reward.py:score",
            "--actor_rollout_ref.rollout.n=4", "--data.train_batch_size=8",
            "--actor_rollout_ref.actor.ppo_mini_batch_size=8", "--algorithm.filter_groups.enable=true",
            "--algorithm.filter_groups.metric=acc", "--trainer.val_before_train=false",
            "--trainer.test_freq=-1", "--trainer.export_hf=false", "--trainer.plot=false", *extra]


@pytest.mark.slow
def test_dynamic_sampling_and_overlong_shaping_through_train_py(tmp_path, tiny_model_dir):
    # Buffer = the whole response (4 tokens), factor 0.5: every trained score is 1 - 0.5 * length / 4.
    torchrun(_args(tmp_path, tiny_model_dir, "dapo", "--reward.overlong_buffer.enable=true",
                   "--reward.overlong_buffer.len=4", "--reward.overlong_buffer.penalty_factor=0.5",
                   "--trainer.total_training_steps=3"))
    rows = [r for r in read_metrics(str(tmp_path / "dapo")) if "train/num_gen_batches" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["training/num_samples"] == 8 * 4, "the step must train on train_batch_size x n responses"
        # At least 8 prompts kept out of num_gen_batches x 8 generated; odd answers are always dropped.
        assert 8 <= r["train/kept_group_fraction"] * r["train/num_gen_batches"] * 8
        assert 0 < r["train/kept_group_fraction"] < 1
        assert r["reward/score_mean"] == 1.0  # the scorer's score, unshaped
        for stat, length in (("mean", "mean"), ("max", "min"), ("min", "max")):
            want = 1.0 - 0.5 * r[f"response_length/{length}"] / 4
            assert r[f"critic/score/{stat}"] == pytest.approx(want, abs=1e-6), (stat, r)
        assert -0.5 <= r["reward/overlong_penalty/mean"] < 0
    assert max(r["train/num_gen_batches"] for r in rows) >= 2, "no step needed a second generation batch"


@pytest.mark.slow
def test_greedy_rollouts_are_filtered_out_and_the_limit_is_named(tmp_path, tiny_model_dir):
    """rollout.do_sample=false reaches the rollout: n greedy samples are one text, so every group has one acc
    and is dropped; the step stops after max_num_gen_batches, naming the setting."""
    import subprocess

    args = _args(tmp_path, tiny_model_dir, "greedy", "--actor_rollout_ref.rollout.do_sample=false",
                 "--algorithm.filter_groups.max_num_gen_batches=2", "--trainer.total_training_steps=1")
    out = subprocess.run(_cmd(args), env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    log = out.stdout + out.stderr
    assert "0 of data.train_batch_size=8 prompts kept after algorithm.filter_groups.max_num_gen_batches=2" in log, \
        log[-4000:]
    assert "do_sample=false with n=4" in log
