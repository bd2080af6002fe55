"""Presets of the single-model trainers: SFT, reward model (Bradley-Terry), DPO.

In these modes the model being trained is `actor_rollout_ref.model`, optimised with
`actor_rollout_ref.actor.optim` and sharded with `actor_rollout_ref.actor.fsdp_config`
(DPO's frozen reference uses `actor_rollout_ref.ref`).

    torchrun --nproc_per_node 8 train.py sft --preset sft --actor_rollout_ref.model.path /models/Qwen2.5-0.5B
    torchrun --nproc_per_node 8 train.py rm  --preset rm  --data.train_files data/prefs/train.parquet
    torchrun --nproc_per_node 8 train.py dpo --preset dpo --data.train_files data/prefs/train.parquet
"""

from __future__ import annotations

from tinyzero.config import Config


def sft() -> Config:
    """SFT on a prompt/response parquet (veRL's gsm8k SFT example: lr 1e-5, batch 256, 4 epochs)."""
    cfg = Config()
    cfg.trainer.mode = "sft"
    d = cfg.data
    d.train_files = ["data/gsm8k_sft/train.parquet"]
    d.val_files = ["data/gsm8k_sft/test.parquet"]
    d.train_batch_size = 256
    d.max_length = 1024
    d.truncation = "right"
    d.apply_chat_template = True
    arr = cfg.actor_rollout_ref
    arr.model.path = "/models/Qwen2.5-0.5B-Instruct"
    arr.model.dtype = "auto"
    arr.model.use_remove_padding = True  # packed rows: no padding computed (the log-probs of DPO too)
    arr.actor.optim.lr = 1e-5
    arr.actor.optim.warmup_style = "cosine"
    arr.actor.optim.lr_warmup_steps_ratio = 0.1
    arr.actor.ppo_micro_batch_size_per_gpu = 4
    t = cfg.trainer
    t.experiment_name = "sft"
    t.default_local_dir = "runs/sft"
    t.total_epochs = 4
    t.test_freq = 50
    t.save_freq = 200
    return cfg


def rm() -> Config:
    """Bradley-Terry reward model on (prompt, chosen, rejected) pairs; plug the export into reward_model.model."""
    cfg = sft()
    cfg.trainer.mode = "rm"
    cfg.data.train_files = ["data/prefs/train.parquet"]
    cfg.data.val_files = ["data/prefs/test.parquet"]
    cfg.data.train_batch_size = 64
    cfg.actor_rollout_ref.actor.optim.lr = 5e-6
    cfg.trainer.experiment_name = "rm"
    cfg.trainer.default_local_dir = "runs/rm"
    cfg.trainer.total_epochs = 1
    return cfg


def dpo() -> Config:
    """DPO on the same pairwise parquet, reference = the initial policy (beta 0.1)."""
    cfg = rm()
    cfg.trainer.mode = "dpo"
    cfg.actor_rollout_ref.actor.optim.lr = 5e-7
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 64  # pairs per optimizer step (= one batch)
    cfg.dpo.beta = 0.1
    cfg.trainer.experiment_name = "dpo"
    cfg.trainer.default_local_dir = "runs/dpo"
    return cfg
