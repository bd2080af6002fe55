"""GRPO on GSM8K with an instruct model (veRL's examples/grpo_trainer gsm8k settings).

    python -m tinyzero.data.preprocess.gsm8k --input gsm8k.jsonl --out data/gsm8k
    torchrun --nproc_per_node 8 train.py --preset gsm8k_grpo \
        --actor_rollout_ref.model.path /models/Qwen2.5-3B-Instruct
"""

from __future__ import annotations

import dataclasses

from tinyzero.config import Config


def gsm8k_grpo() -> Config:
    """GSM8K GRPO: batch 1024 prompts x 5 responses, KL loss low_var_kl 0.001, lr 1e-6."""
    cfg = Config()
    d = cfg.data
    d.train_files = ["data/gsm8k/train.parquet"]
    d.val_files = ["data/gsm8k/test.parquet"]
    d.train_batch_size = 1024
    d.max_prompt_length = 512
    d.max_response_length = 1024
    d.apply_chat_template = True

    arr = cfg.actor_rollout_ref
    arr.model.path = "/models/Qwen2.5-3B-Instruct"
    arr.model.dtype = "auto"
    arr.model.enable_gradient_checkpointing = True
    arr.actor.optim.lr = 1e-6
    arr.actor.ppo_mini_batch_size = 256
    arr.actor.ppo_micro_batch_size_per_gpu = 16
    arr.actor.use_kl_loss = True
    arr.actor.kl_loss_coef = 0.001
    arr.actor.kl_loss_type = "low_var_kl"
    arr.actor.entropy_coeff = 0.0
    # "auto": vLLM on GPU machines where it imports, else the native engine (resolved in __post_init__)
    arr.rollout = dataclasses.replace(arr.rollout, name="auto")
    arr.rollout.n = 5
    arr.rollout.tensor_model_parallel_size = 2
    arr.rollout.gpu_memory_utilization = 0.6
    arr.rollout.log_prob_micro_batch_size_per_gpu = 16
    arr.ref.log_prob_micro_batch_size_per_gpu = 16

    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.use_kl_in_reward = False

    t = cfg.trainer
    t.project_name = "tinyzero-gsm8k"
    t.experiment_name = "gsm8k-grpo"
    t.default_local_dir = "runs/gsm8k-grpo"
    t.total_epochs = 15
    t.test_freq = 5
    t.save_freq = 20
    return cfg
