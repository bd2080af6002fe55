"""ReMax end to end: `algorithm.adv_estimator=remax` through train.py on 2 CPU ranks with the tiny model.

The trainer adds a greedy rollout per prompt, scored by the reward fn, as the baseline
(`reward_baselines`, timed as timing_s/gen_max). With top_k=1 sampling for the trained responses
(greedy too), every response equals its prompt's baseline response, so every advantage must be exactly 0
while the scores themselves vary (a custom reward on the decoded text and the prompt's answer):
that checks the baseline is the right prompt's greedy score after the n-fold repeat and the
batch balancing, on every rank's share.
"""

from __future__ import annotations

import pytest

from tests.test_e2e_train import torchrun
from tinyzero.trainer.loggers import read_metrics

pytestmark = pytest.mark.slow

REWARD = '''
def score(data_source, solution_str, ground_truth, extra_info=None):
    """Varies with the text and the prompt's answer: a zero advantage needs the same prompt's baseline."""
    return ((sum(map(ord, solution_str)) + int(ground_truth)) % 7) / 7.0
'''


def test_remax_trains_with_a_greedy_baseline(tmp_path, tiny_model_dir):
    from tinyzero.demo import build_data

    build_data(str(tmp_path / "data"))
    (tmp_path / "reward.py").write_text(REWARD)
    run = tmp_path / "remax"
    args = ["--preset", "demo_cpu", f"--data.train_files={tmp_path}/data/train.parquet",
            f"--data.val_files={tmp_path}/data/test.parquet", f"--actor_rollout_ref.model.path={tiny_model_dir}",
            f"--trainer.default_local_dir={run}", f"--reward.custom_fn={tmp_path}/reward.py:score",
            "--algorithm.adv_estimator=remax", "--actor_rollout_ref.rollout.n=2",
            "--actor_rollout_ref.rollout.top_k=1", "--data.train_batch_size=8",
            "--actor_rollout_ref.actor.ppo_mini_batch_size=4", "--trainer.total_training_steps=2",
            "--trainer.val_before_train=false", "--trainer.export_hf=false", "--trainer.plot=false"]
    torchrun(args)  # 2 ranks
    rows = [r for r in read_metrics(str(run)) if "critic/advantages/max" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["timing_s/gen_max"] > 0
        assert r["critic/advantages/max"] == 0.0 and r["critic/advantages/min"] == 0.0, r
        assert r["critic/returns/max"] > r["critic/returns/min"], "scores do not vary: the check proves nothing"
        assert r["actor/pg_loss"] == pytest.approx(0.0, abs=1e-7)
