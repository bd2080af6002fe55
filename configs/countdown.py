"""TinyZero's countdown runs on Qwen2.5-3B: PPO as TinyZero's script sets it, and GRPO beside it.

The PPO preset follows TinyZero's scripts/train_tiny_zero.sh over veRL's ppo_trainer.yaml of that
time (fp32 actor and critic weights, no gradient checkpointing, dynamic batch sizes, no
validation before training). docs/getting-started.md ("PPO and GRPO on countdown") lists what still
differs. The GRPO preset is ours: TinyZero's script runs PPO only.

    python -m tinyzero.data.preprocess.countdown --out data/countdown
    torchrun --nproc_per_node 2 train.py --preset countdown_qwen2_5_3b_ppo \
        --actor_rollout_ref.model.path /models/Qwen2.5-3B
"""

from __future__ import annotations

import dataclasses

from tinyzero.config import Config


def countdown_qwen2_5_3b_ppo() -> Config:
    """TinyZero countdown PPO (GAE + critic, KL in the reward, fixed coefficient 0.001)."""
    cfg = Config()
    d = cfg.data
    d.train_files = ["data/countdown/train.parquet"]
    d.val_files = ["data/countdown/test.parquet"]
    d.train_batch_size = 256
    d.val_batch_size = 1312
    d.max_prompt_length = 256
    d.max_response_length = 1024
    d.apply_chat_template = False  # TinyZero's countdown prompts are pre-rendered text

    arr = cfg.actor_rollout_ref
    arr.model.path = "/models/Qwen2.5-3B"
    arr.model.dtype = "fp32"  # fp32 master weights, bf16 compute (veRL's actor then)
    arr.model.enable_gradient_checkpointing = False  # TinyZero leaves veRL's default (off)
    arr.actor.optim.lr = 1e-6
    arr.actor.ppo_mini_batch_size = 64
    arr.actor.ppo_micro_batch_size_per_gpu = 8  # unused while use_dynamic_bsz
    arr.actor.use_dynamic_bsz = True
    arr.actor.ppo_max_token_len_per_gpu = 16384
    arr.actor.entropy_coeff = 0.001
    arr.actor.use_kl_loss = False
    # "auto": vLLM on GPU machines where it imports, else the native engine (resolved in __post_init__)
    arr.rollout = dataclasses.replace(arr.rollout, name="auto")
    arr.rollout.n = 1
    arr.rollout.temperature = 1.0
    arr.rollout.tensor_model_parallel_size = 2
    arr.rollout.gpu_memory_utilization = 0.4
    arr.rollout.log_prob_micro_batch_size_per_gpu = 8
    arr.rollout.log_prob_use_dynamic_bsz = True  # veRL interpolates these from the actor's use_dynamic_bsz
    arr.rollout.log_prob_max_token_len_per_gpu = 16384
    arr.ref.log_prob_micro_batch_size_per_gpu = 4
    arr.ref.log_prob_use_dynamic_bsz = True
    arr.ref.log_prob_max_token_len_per_gpu = 16384

    cfg.critic.optim.lr = 1e-5
    cfg.critic.ppo_mini_batch_size = 64
    cfg.critic.ppo_micro_batch_size_per_gpu = 8
    cfg.critic.use_dynamic_bsz = True
    cfg.critic.ppo_max_token_len_per_gpu = 32768
    cfg.critic.forward_max_token_len_per_gpu = 32768
    cfg.critic.model.dtype = "fp32"
    cfg.critic.model.enable_gradient_checkpointing = False

    alg = cfg.algorithm
    alg.adv_estimator = "gae"
    alg.gamma = 1.0
    alg.lam = 1.0
    alg.use_kl_in_reward = True
    alg.kl_penalty = "kl"
    alg.kl_ctrl.type = "fixed"
    alg.kl_ctrl.kl_coef = 0.001

    t = cfg.trainer
    t.project_name = "TinyZero"
    t.experiment_name = "countdown-qwen2.5-3b-ppo"
    t.default_local_dir = "runs/countdown-qwen2.5-3b-ppo"
    t.total_epochs = 15
    t.test_freq = 100
    t.save_freq = 100
    t.critic_warmup = 0
    t.val_before_train = False
    return cfg


def countdown_qwen2_5_3b_grpo() -> Config:
    """The same run with GRPO: 5 responses per prompt, no critic, KL as a loss (low_var_kl, 0.001)."""
    cfg = countdown_qwen2_5_3b_ppo()
    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.use_kl_in_reward = False
    arr = cfg.actor_rollout_ref
    arr.rollout.n = 5
    arr.actor.use_kl_loss = True
    arr.actor.kl_loss_type = "low_var_kl"
    arr.actor.kl_loss_coef = 0.001
    arr.actor.entropy_coeff = 0.0
    cfg.trainer.experiment_name = "countdown-qwen2.5-3b-grpo"
    cfg.trainer.default_local_dir = "runs/countdown-qwen2.5-3b-grpo"
    return cfg
