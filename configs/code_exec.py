"""The code learning check: the tiny model learns to write one-line Python functions, rewarded only by running them.

`python bench/code_exec.py` builds everything under runs/code_exec/ and runs both stages:

    torchrun --nproc_per_node 2 train.py sft --preset code_exec_cpu_sft    # format warm-up
    torchrun --nproc_per_node 2 train.py --preset code_exec_cpu            # GRPO, execution rewards

Data: tinyzero.data.preprocess.code_tasks ("mul 3:" -> "def f(x):return x*3", tested by calls in
the sandbox). The warm-up's constants are near misses, so GRPO has to find the right programs
from the execution reward alone.
"""

from __future__ import annotations

from tinyzero.configs.demo import demo_cpu, demo_cpu_sft

from tinyzero.config import Config

CODE_DIR = "runs/code_exec"


def code_exec_cpu() -> Config:
    """GRPO on "op k:" -> "def f(x):return x<op>k" with the tiny model, scored in the sandbox."""
    cfg = demo_cpu()
    d = cfg.data
    d.train_files = [f"{CODE_DIR}/data/train.parquet"]
    d.val_files = [f"{CODE_DIR}/data/test.parquet"]
    d.max_prompt_length = 8
    d.max_response_length = 24
    cfg.actor_rollout_ref.model.path = f"{CODE_DIR}/sft/hf_model"
    # Samples score in 4 worker processes per rank (each program is its own sandboxed process).
    cfg.reward.num_workers = 4
    cfg.reward.parallel_min_batch = 1
    s = cfg.reward.sandbox
    s.timeout_s = 1.0
    s.memory_limit_mb = 256
    s.max_concurrent = 4
    t = cfg.trainer
    t.project_name = "tinyzero-code-exec"
    t.experiment_name = "code-exec-cpu-grpo"
    t.default_local_dir = f"{CODE_DIR}/grpo"
    t.total_training_steps = 40
    t.test_freq = 10
    return cfg


def code_exec_cpu_sft() -> Config:
    """The format warm-up: SFT on "op k:" -> a program with a near-miss constant.

    300 steps, not the demo's 60: the constant sits 17 tokens after the spec, and the tiny model learns
    to copy it from the prompt well after it has learned the format. A warm-up that stops before then
    writes one constant distribution for every spec, and GRPO can only move that shared mix.
    """
    cfg = demo_cpu_sft()
    cfg.data.train_files = [f"{CODE_DIR}/data/sft.parquet"]
    cfg.data.max_length = 36
    cfg.data.max_prompt_length = 8
    cfg.data.max_response_length = 24
    cfg.actor_rollout_ref.model.path = f"{CODE_DIR}/tiny_model"
    t = cfg.trainer
    t.project_name = "tinyzero-code-exec"
    t.experiment_name = "code-exec-cpu-sft"
    t.default_local_dir = f"{CODE_DIR}/sft"
    t.total_training_steps = 300
    return cfg
