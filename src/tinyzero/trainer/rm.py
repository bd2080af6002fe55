"""Reward-model training: Bradley-Terry on (prompt, chosen, rejected) pairs with a scalar-head model.

    torchrun --nproc_per_node 8 train.py rm --preset rm --data.train_files data/prefs/train.parquet
    # then PPO with it:  --reward_model.enable true --reward_model.model.path runs/rm/hf_model

loss = -log sigmoid(r(chosen) - r(rejected)), r read at the last token of each sequence;
train/acc and val/acc are the fraction of pairs ranked correctly. The model is loaded as a
sequence-classification model (num_labels=1) from actor_rollout_ref.model.path (a causal LM
folder: the backbone is reused, the head is new), the kind RewardModelWorker loads for PPO.
"""

from __future__ import annotations

from tinyzero.config import Config
from tinyzero.data import PairwiseDataset
from tinyzero.trainer.sft import SupervisedTrainer, build_supervised_trainer


def build_rm_trainer(cfg: Config) -> SupervisedTrainer:
    return build_supervised_trainer(cfg, "rm", PairwiseDataset)
