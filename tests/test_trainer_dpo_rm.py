"""Preference training: the DPO loss vs a float64 loop; RM and DPO learn a separable toy preference set.

The toy set: prompts "a+b=" with both operands in 0..4 or both in 5..9; chosen = the sum, rejected
= the sum +- 10, so a pair is separable by "the answer has as many digits as the operands imply" while
length alone says nothing (half the chosen answers are the longer one). The end-to-end tests launch `torchrun --nproc_per_node 2 train.py rm|dpo` from the
offline tiny model and check that pairwise accuracy / reward margin rise on held-out pairs.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch

from tinyzero.trainer.dpo import make_dpo_policy_loss, pairs_to_rows
from tinyzero.trainer.loggers import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def _reference_dpo(logp, ref, mask, beta, eps, loss_type):
    """Plain float64 loop over pairs (rows 2i chosen, 2i+1 rejected)."""
    total = 0.0
    pairs = logp.shape[0] // 2
    for i in range(pairs):
        ratios = []
        for row in (2 * i, 2 * i + 1):
            ratios.append(sum(float(logp[row, t] - ref[row, t]) for t in range(logp.shape[1]) if mask[row, t]))
        h = ratios[0] - ratios[1]
        if loss_type == "ipo":
            total += (h - 1 / (2 * beta)) ** 2
        else:
            sig = 1 / (1 + math.exp(-beta * h))
            total += -(1 - eps) * math.log(sig) - eps * math.log(1 - sig)
    return total / pairs


@pytest.mark.parametrize("loss_type,beta,eps", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.3, 0.0)])
def test_dpo_loss_matches_float64_loop(loss_type, beta, eps):
    g = torch.Generator().manual_seed(0)
    rows, length = 6, 5
    logp = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(rows, length, generator=g) > 0.3).double()
    mask[:, 0] = 1
    sign = torch.tensor([1.0, -1.0] * (rows // 2), dtype=torch.float64)[:, None].expand(rows, length)
    loss, *_ = make_dpo_policy_loss(beta, eps, loss_type)(ref, logp, sign, mask)
    assert float(loss) == pytest.approx(_reference_dpo(logp, ref, mask, beta, eps, loss_type), rel=1e-12)


def test_pairs_to_rows_layout():
    """Row 2i is pair i's chosen sequence, 2i+1 its rejected one; response t is sequence token t + 1."""
    from tinyzero.protocol import DataProto

    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    attn = (ids > 0).long()
    loss = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])
    loss_rej = torch.tensor([[0, 1, 0, 0], [0, 0, 1, 0]])
    pairs = DataProto.from_dict(tensors={
        "chosen_input_ids": ids, "chosen_attention_mask": attn, "chosen_position_ids": attn.cumsum(-1) - 1,
        "chosen_loss_mask": loss, "rejected_input_ids": ids.flip(0), "rejected_attention_mask": attn.flip(0),
        "rejected_position_ids": (attn.cumsum(-1) - 1).flip(0), "rejected_loss_mask": loss_rej})
    pairs.batch["chosen_loss_mask"][1] = torch.tensor([0, 1, 0, 0])
    rows = pairs_to_rows(pairs)
    assert rows.batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [8, 9, 0, 0], [5, 6, 7, 0]]
    assert rows.batch["responses"].tolist() == [[6, 7, 0], [9, 0, 0], [9, 0, 0], [6, 7, 0]]
    assert rows.batch["response_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 0], [0, 1, 0]]
    assert rows.batch["advantages"][:, 0].tolist() == [1.0, -1.0, 1.0, -1.0]


def write_prefs(path: str, num: int, seed: int) -> None:
    from tinyzero.data.preprocess.common import write_parquet

    rng = random.Random(seed)
    rows = []
    for i in range(num):
        low = 0 if i % 2 else 5  # small operands: one-digit sums; large ones: two-digit sums
        a, b = rng.randrange(low, low + 5), rng.randrange(low, low + 5)
        wrong = a + b + 10 if a + b < 10 else a + b - 10
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "chosen": str(a + b),
                     "rejected": str(wrong)})
    write_parquet(rows, path)


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefs")
    write_prefs(str(root / "train.parquet"), 256, seed=0)
    write_prefs(str(root / "test.parquet"), 64, seed=1)
    return root


def _torchrun(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), *args]
    out = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


def _run(mode: str, root, model: str, *extra: str) -> list[dict]:
    _torchrun([mode, "--preset", mode, f"--data.train_files={root}/train.parquet",
           f"--data.val_files={root}/test.parquet", f"--actor_rollout_ref.model.path={model}",
           f"--trainer.default_local_dir={root}/{mode}", "--trainer.plot=false", f"--trainer.export_hf={mode == 'rm'}",
           "--data.max_length=12", "--data.apply_chat_template=false", "--data.train_batch_size=32",
           "--actor_rollout_ref.model.dtype=fp32", "--actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
           "--actor_rollout_ref.actor.optim.lr=3e-3", "--actor_rollout_ref.actor.optim.warmup_style=constant",
           "--actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0", "--trainer.total_training_steps=16",
           "--trainer.total_epochs=2", "--trainer.test_freq=16", "--trainer.device=cpu", "--trainer.progress_bar=false",
           *extra])
    rows = read_metrics(str(root / mode))
    return [r for r in rows if any(k.startswith("val/") for k in r)]


@pytest.mark.slow
def test_reward_model_accuracy_rises(prefs, tiny_model_dir):
    val = _run("rm", prefs, tiny_model_dir)
    before, after = val[0], val[-1]
    assert before["step"] == 0 and after["step"] == 16
    assert after["val/acc"] >= 0.9 and after["val/acc"] > before["val/acc"] + 0.2, (before, after)
    assert after["val/loss"] < before["val/loss"]
    # The trained RM plugs into PPO as the reward model: its score adds to the rule score.
    from tinyzero.demo import build_data

    build_data(str(prefs / "rl"))
    _torchrun(["--preset", "demo_cpu", f"--data.train_files={prefs}/rl/train.parquet", "--data.val_files",
               f"--actor_rollout_ref.model.path={tiny_model_dir}", f"--trainer.default_local_dir={prefs}/ppo_rm",
               "--reward_model.enable=true", f"--reward_model.model.path={prefs}/rm/hf_model",
               "--data.train_batch_size=8", "--actor_rollout_ref.rollout.n=2", "--trainer.total_training_steps=1",
               "--trainer.plot=false", "--trainer.export_hf=false", "--trainer.val_before_train=false"])
    row = read_metrics(str(prefs / "ppo_rm"))[-1]
    assert row["reward/rm_score/mean"] != 0.0
    assert row["critic/score/mean"] == pytest.approx(row["reward/score_mean"] + row["reward/rm_score/mean"], abs=1e-5)


@pytest.mark.slow
def test_dpo_raises_reward_accuracy_and_margin(prefs, tiny_model_dir):
    val = _run("dpo", prefs, tiny_model_dir, "--dpo.beta=0.5", "--actor_rollout_ref.actor.ppo_mini_batch_size=16",
               "--actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    before, after = val[0], val[-1]
    # The policy starts as the reference: every implicit reward is 0 and the loss is log 2.
    assert before["val/rewards/margins"] == 0.0 and before["val/loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert after["val/rewards/accuracies"] >= 0.9, after
    assert after["val/rewards/margins"] > 0.5 and after["val/loss"] < 0.6 * math.log(2), after
