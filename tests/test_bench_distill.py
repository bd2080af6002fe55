"""bench/distill.py's readers: the validation curve from a trainer's metrics.jsonl (read by
tinyzero.trainer.loggers.read_metrics) and the first step reaching the teacher's score."""

from __future__ import annotations

import json
import math
import random

from bench.distill import curve, first_step_reaching, mean_step_s
from tinyzero.trainer.loggers import read_metrics

KEY = "val-aux/code_exec/reward/mean@1"


def test_curve_and_step_time_from_a_metrics_file(tmp_path):
    lines = [{"step": 0, KEY: 0.0},
             {"step": 1, "timing_s/step": 2.0},
             {"step": 2, "timing_s/step": 4.0, KEY: 1 / 27},
             {"step": 2, "timing_s/step": 3.0},  # a step written twice: the last value wins
             {"step": 3, "timing_s/step": 6.0, KEY: 24 / 27}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + "{truncated\n")
    rows = read_metrics(str(tmp_path))
    assert curve(rows, KEY) == {0: 0.0, 2: 1 / 27, 3: 24 / 27}
    assert mean_step_s(rows) == (2.0 + 3.0 + 6.0) / 3
    assert math.isnan(mean_step_s([{"step": 0, KEY: 0.0}]))  # no training step


def test_first_step_reaching_against_a_loop():
    rng = random.Random(0)
    for _ in range(200):
        steps = sorted(rng.sample(range(0, 60, 5), rng.randint(1, 12)))
        scores = {s: rng.randint(0, 27) / 27 for s in reversed(steps)}  # insertion order is not step order
        target = rng.randint(0, 27) / 27
        expected = None
        for s in steps:
            if round(scores[s] * 27) >= round(target * 27):
                expected = s
                break
        assert first_step_reaching(scores, target) == expected


def test_first_step_reaching_tolerates_float_rounding_only():
    target = sum([1 / 27] * 24)  # 24/27 summed in another order: not bit-equal to 24 / 27
    assert target != 24 / 27
    assert first_step_reaching({5: 24 / 27}, target) == 5
    assert first_step_reaching({5: 23 / 27, 10: 24 / 27}, 24 / 27) == 10
    assert first_step_reaching({5: 0.5}, 1.0) is None
