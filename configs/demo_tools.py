"""The tools demo on CPU: the offline tiny model learns to use a calculator for "23*456=" with GRPO.

`python -m tinyzero.demo --task tools` builds everything under runs/demo_tools/ and runs both stages:

    torchrun --nproc_per_node 2 train.py sft --preset demo_cpu_tools_sft   # tool-call format warm-up
    torchrun --nproc_per_node 2 train.py --preset demo_cpu_tools           # GRPO, calculator in the loop

Some of the warm-up's conversations call the calculator and answer its result, the others guess
(the question's larger factor), so the policy starts by guessing more often than it calls; GRPO has
to teach it that calling pays (see tinyzero.demo_tools).
"""

from __future__ import annotations

from tinyzero.configs.demo import demo_cpu, demo_cpu_sft

from tinyzero.config import Config

DEMO_TOOLS_DIR = "runs/demo_tools"


def demo_cpu_tools() -> Config:
    """GRPO on "a*b=" with the calculator tool in the agent loop (a call, the tool's turn, the answer)."""
    cfg = demo_cpu()
    d = cfg.data
    d.train_files = [f"{DEMO_TOOLS_DIR}/data/train.parquet"]
    d.val_files = [f"{DEMO_TOOLS_DIR}/data/test.parquet"]
    d.apply_chat_template = True
    d.max_prompt_length = 32
    d.max_response_length = 144  # call 84 + observation 26 + answer 23 tokens (byte-level tokenizer)

    arr = cfg.actor_rollout_ref
    arr.model.path = f"{DEMO_TOOLS_DIR}/sft/hf_model"
    arr.actor.optim.lr = 2e-4  # higher rates break the long tool-call format of the samples that fail (5e-4: often)
    mt = arr.rollout.multi_turn
    mt.enable = True
    mt.tools = ["calculator"]
    mt.max_turns = 2
    mt.num_tool_workers = 1

    t = cfg.trainer
    t.experiment_name = "demo-cpu-tools-grpo"
    t.default_local_dir = f"{DEMO_TOOLS_DIR}/grpo"
    t.total_training_steps = 20
    t.test_freq = 5
    t.export_hf = True  # the demo validates the trained policy once more, with the calculator disabled
    return cfg


def demo_cpu_tools_sft() -> Config:
    """The format warm-up: multi-turn SFT on tool conversations and direct guesses (tinyzero.demo_tools)."""
    cfg = demo_cpu_sft()
    base = demo_cpu_tools()
    d = cfg.data
    d.train_files = [f"{DEMO_TOOLS_DIR}/data/sft.parquet"]
    d.apply_chat_template = True
    d.messages_key = "messages"
    d.max_prompt_length = base.data.max_prompt_length
    d.max_response_length = base.data.max_response_length
    d.max_length = 160
    cfg.actor_rollout_ref.model.path = f"{DEMO_TOOLS_DIR}/tiny_model"
    cfg.actor_rollout_ref.model.use_remove_padding = True  # direct guesses are a third of a call's length
    optim = cfg.actor_rollout_ref.actor.optim
    optim.warmup_style = "cosine"  # the copying of operands and results is learned late (a few hundred steps)
    optim.lr_warmup_steps = 50
    t = cfg.trainer
    t.experiment_name = "demo-cpu-tools-sft"
    t.default_local_dir = f"{DEMO_TOOLS_DIR}/sft"
    t.total_training_steps = 1200
    return cfg
