"""Trainer pieces against plain references: batch balancing, step metrics, FLOPs, metrics.jsonl resume."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch

from tinyzero.protocol import DataProto
from tinyzero.trainer.balance import balance_batch, balanced_equal_partitions
from tinyzero.trainer.loggers import JsonlLogger, read_metrics
from tinyzero.trainer.metrics import compute_data_metrics, model_flops_per_token, reduce_metrics


@pytest.mark.parametrize("seed", range(5))
def test_balanced_partitions_equal_rows_near_optimal(seed):
    rng = random.Random(seed)
    lengths = [rng.randrange(1, 50) for _ in range(8)]
    parts = balanced_equal_partitions(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(8)) and all(len(p) == 4 for p in parts)
    spread = abs(sum(lengths[i] for i in parts[0]) - sum(lengths[i] for i in parts[1]))
    # Brute force over every equal split: greedy is within the longest item of the optimum.
    best = min(abs(sum(lengths[i] for i in c) - (sum(lengths) - sum(lengths[i] for i in c)))
               for c in itertools.combinations(range(8), 4))
    assert spread <= best + max(lengths)


def test_balance_batch_reorders_rows_consistently():
    mask = torch.zeros(8, 10, dtype=torch.long)
    for i, n in enumerate([10, 1, 9, 2, 8, 3, 7, 4]):
        mask[i, :n] = 1
    batch = DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(8)},
                                non_tensors={"uid": np.array([f"u{i}" for i in range(8)], dtype=object)})
    metrics = {}
    balance_batch(batch, 2, metrics)
    sums = batch.batch["attention_mask"].sum(-1)
    assert abs(int(sums[:4].sum()) - int(sums[4:].sum())) <= 2
    assert [f"u{int(r)}" for r in batch.batch["row"]] == list(batch.non_tensor_batch["uid"])  # rows move whole
    assert metrics["training/seqlen_balance_max_min_ratio"] == pytest.approx(
        max(sums[:4].sum(), sums[4:].sum()).item() / min(sums[:4].sum(), sums[4:].sum()).item())


def test_data_metrics_match_a_loop():
    g = torch.Generator().manual_seed(0)
    rows, r = 6, 5
    resp_len = [5, 2, 0, 3, 5, 1]
    response_mask = torch.tensor([[1] * n + [0] * (r - n) for n in resp_len], dtype=torch.float32)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    scores = torch.zeros(rows, r)
    for i, n in enumerate(resp_len):
        scores[i, max(n - 1, 0)] = float(i % 3) / 2
    adv = torch.randn(rows, r, generator=g)
    batch = DataProto.from_dict(tensors={
        "responses": torch.zeros(rows, r, dtype=torch.long), "response_mask": response_mask,
        "attention_mask": torch.cat([prompt_mask, response_mask.long()], -1), "token_level_scores": scores,
        "token_level_rewards": scores - 0.1, "advantages": adv, "returns": adv * 2})
    m = compute_data_metrics(batch, use_critic=False)
    # veRL: score and reward statistics over the responses that are not aborted (empty): row 2 is left out.
    kept = [i for i in range(rows) if resp_len[i] > 0]
    seq_scores = [float(scores[i].sum()) for i in kept]
    assert m["critic/score/mean"] == pytest.approx(sum(seq_scores) / len(kept))
    assert m["critic/score/min"] == min(seq_scores) and m["critic/score/max"] == max(seq_scores)
    assert m["critic/rewards/mean"] == pytest.approx(sum(s - 0.1 * r for s in seq_scores) / len(kept), abs=1e-6)
    valid = [float(adv[i, t]) for i in range(rows) for t in range(r) if response_mask[i, t]]
    assert m["critic/advantages/mean"] == pytest.approx(sum(valid) / len(valid), rel=1e-5)
    assert m["critic/advantages/max"] == pytest.approx(max(valid))
    assert m["response_length/mean"] == pytest.approx(sum(resp_len) / rows)
    assert m["response_length/clip_ratio"] == pytest.approx(sum(n >= r for n in resp_len) / rows)
    assert m["response/aborted_ratio"] == pytest.approx(1 / rows)
    assert m["response_length_non_aborted/mean"] == pytest.approx(sum(resp_len) / len(kept))
    assert m["response_length_non_aborted/min"] == 1 and m["response_length_non_aborted/max"] == r
    assert m["response_length_non_aborted/clip_ratio"] == pytest.approx(2 / len(kept))
    assert m["prompt_length/mean"] == pytest.approx(float(prompt_mask.sum()) / rows)


def test_flops_per_token_counts_the_matmul_weights(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_config(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if cfg.tie_word_embeddings:  # lm_head shares the embedding; it is still a matmul per token
        assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model_flops_per_token(cfg, 0) == 6.0 * linear
    seq = 100
    extra = model_flops_per_token(cfg, seq) - model_flops_per_token(cfg, 0)
    assert extra == 6.0 * cfg.num_hidden_layers * cfg.hidden_size * seq


def test_metrics_jsonl_resume_drops_redone_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = JsonlLogger(str(path))
    log.start(0)
    for step in range(1, 5):
        log.log({"x": float(step)}, step)
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 5, "x": ')  # a line torn by a kill
    log = JsonlLogger(str(path))
    log.start(3)  # resumed from the step-2 checkpoint
    log.log({"x": 30.0}, 3)
    log.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in lines] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]


def test_reduce_metrics_means_lists():
    out = reduce_metrics({"a": [1.0, 2.0, 6.0], "b": 3, "c": torch.tensor([1.0, 3.0])})
    assert out == {"a": 3.0, "b": 3.0, "c": 2.0}
