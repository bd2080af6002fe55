"""The CPU demo: the offline tiny model learns single-digit addition with GRPO on 2 CPU ranks.

`python -m tinyzero.demo` builds everything under runs/demo/ and runs both stages:

    torchrun --nproc_per_node 2 train.py sft --preset demo_cpu_sft      # format warm-up
    torchrun --nproc_per_node 2 train.py --preset demo_cpu              # GRPO

The warm-up teaches the answer format only (its targets are near misses, the sum + 1 or + 2), so
the policy starts with almost no right answers; GRPO has to find them from the reward alone.
"""

from __future__ import annotations

from tinyzero.config import Config

DEMO_DIR = "runs/demo"


def demo_cpu() -> Config:
    """GRPO on "a+b=" -> "c" with the tiny model: 32 prompts x 8 samples per step, 4 updates per step."""
    cfg = Config()
    d = cfg.data
    d.train_files = [f"{DEMO_DIR}/data/train.parquet"]
    d.val_files = [f"{DEMO_DIR}/data/test.parquet"]
    d.train_batch_size = 32
    d.val_batch_size = None
    d.max_prompt_length = 8
    d.max_response_length = 4
    d.apply_chat_template = False
    d.truncation = "error"

    arr = cfg.actor_rollout_ref
    arr.model.path = f"{DEMO_DIR}/sft/hf_model"
    arr.model.dtype = "fp32"
    arr.model.enable_gradient_checkpointing = False
    arr.model.attn_implementation = "sdpa"
    a = arr.actor
    a.optim.lr = 1e-3
    a.optim.weight_decay = 0.0
    a.ppo_mini_batch_size = 8
    a.ppo_micro_batch_size_per_gpu = None
    a.use_kl_loss = False
    a.entropy_coeff = 0.0
    a.grad_clip = 1.0
    a.fsdp_config.mixed_precision.param_dtype = "fp32"
    # Layers of a few hundred thousand parameters stay in one FSDP unit with the embeddings: one
    # all-gather per forward and one reduce-scatter per backward instead of one each per layer.
    a.fsdp_config.wrap_policy.min_num_params = 1_000_000
    arr.ref.fsdp_config.wrap_policy.min_num_params = 1_000_000
    cfg.critic.fsdp_config.wrap_policy.min_num_params = 1_000_000
    arr.rollout.name = "native"
    arr.rollout.n = 8
    arr.rollout.temperature = 1.0
    arr.rollout.log_prob_micro_batch_size_per_gpu = 256
    arr.rollout.seed = 0

    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.use_kl_in_reward = False
    cfg.reward.num_workers = 0

    t = cfg.trainer
    t.project_name = "tinyzero-demo"
    t.experiment_name = "demo-cpu-grpo"
    t.default_local_dir = f"{DEMO_DIR}/grpo"
    t.total_epochs = 1000
    t.total_training_steps = 60
    t.test_freq = 10
    t.save_freq = -1
    t.val_before_train = True
    t.export_hf = False
    t.device = "cpu"
    return cfg


def demo_cpu_sft() -> Config:
    """The format warm-up: SFT of the tiny model on "a+b=" -> a random sum (answer format, not the answer)."""
    cfg = demo_cpu()
    cfg.trainer.mode = "sft"
    cfg.data.train_files = [f"{DEMO_DIR}/data/sft.parquet"]
    cfg.data.val_files = []
    cfg.data.train_batch_size = 64
    cfg.data.max_length = 12
    cfg.data.truncation = "error"
    cfg.actor_rollout_ref.model.path = f"{DEMO_DIR}/tiny_model"
    cfg.actor_rollout_ref.actor.optim.lr = 3e-3
    cfg.actor_rollout_ref.actor.optim.weight_decay = 0.0
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = None
    t = cfg.trainer
    t.experiment_name = "demo-cpu-sft"
    t.default_local_dir = f"{DEMO_DIR}/sft"
    t.total_training_steps = 60
    t.test_freq = -1
    t.export_hf = True
    return cfg
