"""Presets: Python functions returning the root `tinyzero.config.Config`.

`train.py --preset NAME` takes one as the defaults under the command-line flags. A variant
calls its base and changes a few fields (see countdown.py).

    from tinyzero.configs import PRESETS
    cfg = PRESETS["countdown_qwen2_5_3b_grpo"]()
"""

from __future__ import annotations

from collections.abc import Callable

from tinyzero.configs.code_exec import code_exec_cpu, code_exec_cpu_sft
from tinyzero.configs.countdown import countdown_qwen2_5_3b_grpo, countdown_qwen2_5_3b_ppo
from tinyzero.configs.demo import demo_cpu, demo_cpu_sft
from tinyzero.configs.demo_tools import demo_cpu_tools, demo_cpu_tools_sft
from tinyzero.configs.gsm8k import gsm8k_grpo
from tinyzero.configs.real import real_cpu
from tinyzero.configs.sft_rm import dpo, rm, sft

PRESETS: dict[str, Callable] = {
    fn.__name__: fn
    for fn in (demo_cpu, demo_cpu_sft, demo_cpu_tools, demo_cpu_tools_sft, countdown_qwen2_5_3b_ppo, countdown_qwen2_5_3b_grpo, gsm8k_grpo, sft, rm, dpo, real_cpu,
               code_exec_cpu, code_exec_cpu_sft)
}

__all__ = ["PRESETS"]
