"""AdamW and learning-rate schedules with veRL's semantics.

Warmup is linear from 0: at scheduler step s < W the factor is s / W. After warmup the
factor is 1 ("constant") or a cosine from 1 down to `min_lr_ratio` over the remaining
`total_training_steps - W` steps ("cosine", `num_cycles` = 0.5 is one half period).
The number of warmup steps is `lr_warmup_steps` when it is >= 0, else
`int(lr_warmup_steps_ratio * total_training_steps)`. The scheduler steps once per update
call (one `update_actor` / `update_critic`), like veRL.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from tinyzero.workers.config import OptimConfig


def num_warmup_steps(config: OptimConfig) -> int:
    """Warmup steps from the config (explicit count first, then the ratio of total steps)."""
    if config.lr_warmup_steps >= 0:
        return int(config.lr_warmup_steps)
    total = max(config.total_training_steps, 0)
    return int(config.lr_warmup_steps_ratio * total)


def constant_lr_factor(step: int, warmup: int) -> float:
    """Linear warmup to 1, then 1."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    return 1.0


def cosine_lr_factor(step: int, warmup: int, total: int, min_lr_ratio: float = 0.0,
                     num_cycles: float = 0.5) -> float:
    """Linear warmup to 1, then a cosine from 1 to min_lr_ratio over total - warmup steps."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    cos = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
    return max(0.0, cos * (1.0 - min_lr_ratio) * 0.5 + (1.0 + min_lr_ratio) * 0.5)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> LambdaLR:
    """The schedule named by `config.warmup_style` as a LambdaLR on `optimizer`."""
    warmup = num_warmup_steps(config)
    if config.warmup_style == "constant":
        def factor(step: int) -> float:
            return constant_lr_factor(step, warmup)
    elif config.warmup_style == "cosine":
        if config.total_training_steps <= 0:
            raise ValueError("optim.total_training_steps must be set (> 0) for warmup_style='cosine'; "
                             "the trainer sets it from trainer.total_training_steps")
        total, min_ratio, cycles = config.total_training_steps, config.min_lr_ratio, config.num_cycles

        def factor(step: int) -> float:
            return cosine_lr_factor(step, warmup, total, min_ratio, cycles)
    else:  # validated by OptimConfig
        raise ValueError(f"unknown optim.warmup_style {config.warmup_style!r}")
    return LambdaLR(optimizer, factor)


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with the kernel `config.implementation` names."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    impl = config.implementation
    if impl == "auto":
        impl = "fused" if all(p.device.type in ("cpu", "cuda") for p in params) else "foreach"
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, **kernel)
