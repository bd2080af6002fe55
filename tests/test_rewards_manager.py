"""RewardManager on real tokenized batches: placement at the last valid token, metrics, failures, pool."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tinyzero.protocol import DataProto
from tinyzero.rewards import RewardConfig, RewardManager, default_compute_score

CD = {"target": 64, "numbers": [3, 5, 8]}
SAMPLES = [
    ("countdown", "think\n<answer>(3 + 5) * 8</answer>", CD, {}),
    ("countdown", "<answer>3 + 5 + 8</answer>", CD, {}),
    ("countdown", "no answer at all, rambling on and on", CD, {}),
    ("openai/gsm8k", "2 + 3 = 5\n#### 5", "5", {}),
    ("openai/gsm8k", "#### 6", "5", {}),
    ("arithmetic", "19", "19", {"answer_format": "plain"}),
    ("arithmetic", "", "19", {"answer_format": "plain"}),  # empty response
    ("arithmetic", "18", "19", {"answer_format": "plain"}),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _batch(tokenizer, samples, response_len=48, use_attention_mask=False):
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    responses = torch.full((len(samples), response_len), pad, dtype=torch.long)
    mask = torch.zeros(len(samples), response_len, dtype=torch.long)
    lengths = []
    for i, (_, text, _, _) in enumerate(samples):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = (ids + [eos])[:response_len] if text else []
        responses[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, :len(ids)] = 1
        lengths.append(len(ids))
    prompts = torch.full((len(samples), 4), pad, dtype=torch.long)
    prompts[:, -2:] = torch.tensor(tokenizer("Q:", add_special_tokens=False)["input_ids"])
    prompt_mask = torch.zeros(len(samples), 4, dtype=torch.long)
    prompt_mask[:, -2:] = 1
    tensors = {"responses": responses, "prompts": prompts}
    if use_attention_mask:
        tensors["attention_mask"] = torch.cat([prompt_mask, mask], dim=1)
    else:
        tensors["response_mask"] = mask
        tensors["attention_mask"] = torch.cat([prompt_mask, mask], dim=1)
    non_tensors = {
        "data_source": np.array([s[0] for s in samples], dtype=object),
        "reward_model": [{"style": "rule", "ground_truth": s[2]} for s in samples],
        "extra_info": [s[3] for s in samples],
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors), lengths


@pytest.mark.parametrize("use_attention_mask", [False, True])
def test_scores_placed_at_last_valid_token(tokenizer, use_attention_mask):
    data, lengths = _batch(tokenizer, SAMPLES, use_attention_mask=use_attention_mask)
    out = RewardManager(tokenizer, RewardConfig(num_workers=0))(data)
    expected = [default_compute_score(ds, text, gt, extra) for ds, text, gt, extra in SAMPLES]
    assert expected == [1.0, 0.1, 0.0, 1.0, 0.0, 1.0, 0.0, 0.1]
    tls = out.token_level_scores
    assert tls.shape == data.batch["responses"].shape and tls.dtype == torch.float32
    for i, n in enumerate(lengths):
        ref = torch.zeros(tls.shape[1])
        if n:
            ref[n - 1] = expected[i]
        torch.testing.assert_close(tls[i], ref, rtol=0, atol=0)
    torch.testing.assert_close(out.scores, torch.tensor(expected))
    assert [s["response"] for s in out.samples] == [s[1] for s in SAMPLES]  # eos dropped on decode
    assert out.samples[0]["prompt"].endswith("Q:")


def test_metrics_per_data_source(tokenizer):
    data, _ = _batch(tokenizer, SAMPLES)
    m = RewardManager(tokenizer, RewardConfig(num_workers=0))(data).metrics
    assert m["reward/countdown/score_mean"] == pytest.approx((1.0 + 0.1 + 0.0) / 3)
    assert m["reward/countdown/acc"] == pytest.approx(1 / 3)
    assert m["reward/countdown/format_rate"] == pytest.approx(2 / 3)
    assert m["reward/openai/gsm8k/acc"] == pytest.approx(0.5)
    assert m["reward/openai/gsm8k/format_rate"] == pytest.approx(1.0)
    assert m["reward/arithmetic/score_mean"] == pytest.approx(1.1 / 3)
    assert m["reward/arithmetic/count"] == 3
    assert m["reward/acc"] == pytest.approx(3 / 8)
    assert m["reward/num_errors"] == 0 and m["reward/num_timeouts"] == 0


def test_scorer_errors_and_timeouts_give_zero(tokenizer, tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text(
        "import time\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if 'boom' in solution_str:\n"
        "        raise RuntimeError('broken scorer')\n"
        "    if 'slow' in solution_str:\n"
        "        try:\n"
        "            time.sleep(30)\n"
        "        except Exception:\n"
        "            return 1.0  # a scorer that swallows exceptions still cannot escape the limit\n"
        "    return 1.0\n"
    )
    samples = [("x", "fine", "g", {}), ("x", "boom", "g", {}), ("x", "slow", "g", {}), ("x", "fine", "g", {})]
    data, _ = _batch(tokenizer, samples)
    rm = RewardManager(tokenizer, RewardConfig(num_workers=0, custom_fn=f"{path}:score", timeout_s=0.3,
                                               on_error="zero"))
    rm.check_data_sources(["anything"])  # a custom function scores every data_source
    out = rm(data)
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert out.metrics["reward/num_errors"] == 1 and out.metrics["reward/num_timeouts"] == 1
    assert "broken scorer" in out.samples[1]["error"] and out.samples[2]["timeout"]


def test_unknown_data_source_fails_at_start_up(tokenizer):
    rm = RewardManager(tokenizer, RewardConfig(num_workers=0))
    with pytest.raises(ValueError, match="no reward function"):
        rm.check_data_sources(["countdown", "mystery"])


def test_process_pool_matches_in_process(tokenizer):
    samples = SAMPLES * 8
    data, _ = _batch(tokenizer, samples)
    serial = RewardManager(tokenizer, RewardConfig(num_workers=0))(data)
    rm = RewardManager(tokenizer, RewardConfig(num_workers=2, parallel_min_batch=16))
    try:
        pooled = rm(data)
        pooled_again = rm(data)  # the pool is reused
    finally:
        rm.close()
    assert pooled.metrics["reward/parallel"] == 1.0 and serial.metrics["reward/parallel"] == 0.0
    torch.testing.assert_close(pooled.token_level_scores, serial.token_level_scores, rtol=0, atol=0)
    torch.testing.assert_close(pooled_again.token_level_scores, serial.token_level_scores, rtol=0, atol=0)
    assert {k: v for k, v in pooled.metrics.items() if not k.startswith(("timing", "reward/parallel"))} == {
        k: v for k, v in serial.metrics.items() if not k.startswith(("timing", "reward/parallel"))}


def test_reward_config_validation():
    with pytest.raises(ValueError, match="reward.num_workers"):
        RewardConfig(num_workers=-1)
    with pytest.raises(ValueError, match="reward.gsm8k_method"):
        RewardConfig(gsm8k_method="fuzzy")
    with pytest.raises(ValueError, match="reward.custom_fn"):
        RewardConfig(custom_fn="file_without_function.py")


def test_pool_kills_a_worker_stuck_past_its_deadline(tmp_path):
    from tinyzero.rewards.scoring import ScoringPool

    path = tmp_path / "stuck.py"
    path.write_text(
        "import signal, time\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'hang':\n"
        "        signal.signal(signal.SIGALRM, signal.SIG_IGN)  # defeats the per-sample alarm\n"
        "        time.sleep(60)\n"
        "    return 1.0\n"
    )
    pool = ScoringPool(2, custom_fn=f"{path}:score", timeout_s=0.2, kill_grace_s=1.0)
    try:
        tasks = [("x", "ok", "g", None), ("x", "ok", "g", None), ("x", "hang", "g", None), ("x", "ok", "g", None)]
        start = time.perf_counter()
        results = pool.score(tasks)
        assert time.perf_counter() - start < 20
        assert [r["score"] for r in results] == [1.0, 1.0, 0.0, 1.0]  # only the stuck sample times out
        assert [r["timeout"] for r in results] == [False, False, True, False]
        # The next call gets a fresh worker.
        assert [r["score"] for r in pool.score(tasks[:2] * 2)] == [1.0] * 4
    finally:
        pool.close()
