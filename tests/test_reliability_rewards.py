"""Rewards never hang and never train silently on wrong values.

User functions (reward.custom_fn) written by the tests: one that swallows the time limit in a bare
`except:` loop, one too slow for the batch budget, ones that raise or return None, a string, a dict
without "score", NaN or inf. On 2 gloo ranks every sample is scored once and every rank gets the
same scores; a rank with a different batch stops the run, named.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tinyzero.protocol import DataProto
from tinyzero.rewards import RewardConfig
from tinyzero.rewards.manager import RewardError, RewardManager

FUNCTIONS = '''
import math, os, time


def swallow(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        while True:  # catches the time limit, every time
            try:
                time.sleep(1)
            except:  # noqa: E722
                pass
    return 1.0


def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.4)
    return 1.0


BAD = {"none": None, "string": "0.5", "nodict": {"acc": True}, "nan": math.nan, "inf": -math.inf,
       "nanscore": {"score": math.nan}}


def bad(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise KeyError("no such field in ground_truth")
    return BAD.get(solution_str, 1.0)


def by_rank(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise" and os.environ["RANK"] == "1":
        raise RuntimeError("only rank 1 sees this")
    return float(os.environ["RANK"]) + 10.0 * int(solution_str.split()[-1])
'''


class CharTokenizer:
    """Characters as token ids (a real decode, no model files): id = ord(char)."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(i) for i in row) for row in ids]


def _batch(texts: list[str], data_source: str = "my_source") -> DataProto:
    length = max(len(t) for t in texts) + 1
    responses = torch.zeros(len(texts), length, dtype=torch.long)
    mask = torch.zeros(len(texts), length, dtype=torch.long)
    for i, t in enumerate(texts):
        responses[i, :len(t)] = torch.tensor([ord(c) for c in t])
        mask[i, :len(t)] = 1
    return DataProto.from_dict(
        tensors={"responses": responses, "response_mask": mask},
        non_tensors={"data_source": np.array([data_source] * len(texts), dtype=object),
                     "reward_model": [{"ground_truth": f"gt{i}"} for i in range(len(texts))]})


@pytest.fixture(scope="module")
def fns(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward_fns") / "fns.py"
    path.write_text(FUNCTIONS)
    return str(path)


def _manager(fns: str, name: str, **kw) -> RewardManager:
    return RewardManager(CharTokenizer(), RewardConfig(custom_fn=f"{fns}:{name}", **kw))


@pytest.mark.slow
def test_function_swallowing_the_time_limit_is_killed_and_named(fns, capsys):
    rm = _manager(fns, "swallow", timeout_s=0.5, num_workers=1, on_error="raise")
    try:
        start = time.monotonic()
        out = rm(_batch(["ok", "hang", "ok"]))
        elapsed = time.monotonic() - start
    finally:
        rm.close()
    # 0.5 s limit + the 2 s kill grace, then a fresh worker scores the last sample.
    assert elapsed < 8, elapsed
    assert out.scores.tolist() == [1.0, 0.0, 1.0]
    assert out.metrics["reward/num_timeouts"] == 1 and out.metrics["reward/num_errors"] == 0
    err = capsys.readouterr().err
    assert f"{fns}:swallow" in err and "sample 1 " in err and "reward.timeout_s=0.5" in err, err


def test_slow_function_stops_at_the_batch_budget(fns):
    rm = _manager(fns, "slow", num_workers=1, batch_timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError) as info:
            rm(_batch([f"r{i}" for i in range(20)]))  # 20 x 0.4 s would be 8 s
        assert time.monotonic() - start < 5
    finally:
        rm.close()
    msg = str(info.value)
    assert f"{fns}:slow" in msg and "reward.batch_timeout_s=1 s" in msg and "in flight: sample " in msg, msg


def test_slow_function_with_on_error_zero_keeps_what_was_scored(fns, capsys, monkeypatch):
    import tinyzero.rewards.manager as manager

    monkeypatch.setattr(manager, "PROGRESS_EVERY_S", 0.0)  # a progress line at every scored sample
    rm = _manager(fns, "slow", num_workers=2, batch_timeout_s=1.0, on_error="zero")
    try:
        out = rm(_batch([f"r{i}" for i in range(20)]))
    finally:
        rm.close()
    captured = capsys.readouterr()
    err = captured.err
    assert f"/20 samples scored by reward.custom_fn {fns}:slow in " in captured.out
    scores = out.scores.tolist()
    scored = sum(s == 1.0 for s in scores)
    assert 2 <= scored < 20 and set(scores) == {0.0, 1.0}, scores
    assert out.metrics["reward/num_timeouts"] == 20 - scored
    assert "did not finish the batch within reward.batch_timeout_s=1 s" in err


@pytest.mark.parametrize("response,expected", [
    ("none", "must be a number, got NoneType"), ("string", "must be a number, got str"),
    ("nodict", "without a 'score' key"), ("nan", "not finite: nan"), ("inf", "not finite: -inf"),
    ("nanscore", "result['score'] is not finite"), ("raise", "KeyError: 'no such field in ground_truth'"),
])
def test_invalid_reward_raises_naming_the_sample(fns, response, expected):
    rm = _manager(fns, "bad")
    try:
        with pytest.raises(RewardError) as info:
            rm(_batch(["fine", response], data_source="gsm8k_custom"))
    finally:
        rm.close()
    msg = str(info.value)
    assert expected in msg and "sample 1 (data_source 'gsm8k_custom'" in msg and "ground_truth 'gt1'" in msg, msg
    assert "reward.on_error zero" in msg
    if response == "raise":
        assert 'fns.py", line' in msg and "in bad" in msg, msg  # the function's own traceback


def test_on_error_zero_counts_and_prints_the_first_traceback_once(fns, capsys):
    rm = _manager(fns, "bad", on_error="zero")
    try:
        out = rm(_batch(["fine", "raise", "nan", "none"]))
        first = capsys.readouterr().err
        again = rm(_batch(["raise", "fine"]))
    finally:
        rm.close()
    assert out.scores.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.metrics["reward/num_errors"] == 3 and again.metrics["reward/num_errors"] == 1
    assert "3 sample(s) failed" in first and "KeyError" in first and "sample 1 " in first, first
    assert capsys.readouterr().err == ""  # printed once per run


def test_built_in_scorer_nan_is_caught_where_computed():
    from tinyzero.rewards.registry import SCORERS, register_scorer

    @register_scorer("always_nan_test")
    def _nan(solution_str, ground_truth, extra_info=None, **_):
        return {"score": float("nan")}

    try:
        rm = RewardManager(CharTokenizer(), RewardConfig(num_workers=0))
        with pytest.raises(RewardError, match=r"built-in scorer of data_source 'always_nan_test' failed on sample 0"):
            rm(_batch(["x"], data_source="always_nan_test"))
    finally:
        SCORERS.pop("always_nan_test")


def _two_ranks(fns: str) -> dict:
    """Three batches on each rank: a plain one, one that differs on rank 1, one that fails on rank 1."""
    from tinyzero.distributed import get_rank, init_distributed

    init_distributed(timeout_s=60)
    rank = get_rank()
    out = {}
    for case in ("plain", "diverge", "raise"):
        texts = [f"answer {i}" for i in range(6)]
        if case == "diverge" and rank == 1:
            texts[3] = "answer 99"
        if case == "raise":
            texts[5] = "raise"
        rm = _manager(fns, "by_rank", num_workers=1)
        try:
            out[case] = rm(_batch(texts)).scores.tolist()
        except RewardError as e:
            out[case] = str(e)
        finally:
            rm.close()
    return out


def test_each_sample_scored_once_and_a_divergent_or_failing_rank_is_named(fns):
    from tests.dist_utils import run_distributed

    got = run_distributed(_two_ranks, 2, fns, timeout=120)
    # Sample i is scored on rank i % 2 (by_rank adds the scoring rank), and every rank holds all of them.
    expected = [float(i % 2) + 10.0 * i for i in range(6)]
    assert got[0]["plain"] == got[1]["plain"] == expected
    assert all(isinstance(g["diverge"], str) and "rank(s) [1] hold a different batch" in g["diverge"] for g in got)
    raised = [g["raise"] for g in got]
    assert raised[0] == raised[1], raised  # the same decision on every rank
    assert "only rank 1 sees this" in raised[0] and "sample 5 (data_source 'my_source', scored on rank 1" in raised[0]


def test_a_worker_that_cannot_load_the_function_is_an_error_not_a_hang(tmp_path):
    path = tmp_path / "parent_only.py"
    path.write_text(
        "import sys\n"
        "main = getattr(sys.modules['__main__'], '__spec__', None)\n"
        "if main is not None and main.name == 'tinyzero.rewards.scoring_worker':\n"
        "    raise ImportError('a module missing in the worker environment')\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0\n")
    rm = RewardManager(CharTokenizer(), RewardConfig(custom_fn=f"{path}:score"))  # loads in this process
    try:
        with pytest.raises(RewardError, match=r"could not load its scorer: .*parent_only\.py. failed with ImportError: a module missing"):
            rm(_batch(["a", "b"]))
    finally:
        rm.close()
