"""The training loop the actor and the critic share, and its pieces.

`run_update` is the one PPO update loop of both (epochs, mini-batches, micro-batches, optimizer
steps, the lr schedule); the roles differ only in their micro-batch loss and statistics. `mini_batches` splits a rank's rows into optimizer-step mini-batches;
`accumulate_gradients` runs the micro-batches of one mini-batch with exact loss scaling
(tinyzero.workers.scaling) and sums the weighted statistics; `optimizer_step` clips the
gradient norm and steps, or skips the step when the norm is not finite.
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from tinyzero.protocol import DataProto
from tinyzero.runtime.progress import report_progress
from tinyzero.workers.scaling import all_reduce_sum, global_counts, micro_weight, token_weight

logger = logging.getLogger(__name__)


def run_update(trained, data: DataProto, rows_per_mini_batch: int, micro_loss: Callable[[dict], tuple],
               stat_names: Sequence[str], stat_kinds: Sequence[str], role: str,
               after_first_accumulate: Callable[[], None] | None = None) -> dict[str, float]:
    """One update of `trained` (a workers.common.TrainedModel: the actor or the critic) over this rank's rows:
    config.ppo_epochs passes, each over mini-batches of rows_per_mini_batch rows (reshuffled per epoch when
    config.shuffle, from the config seed and the update count), each split into micro-batches whose gradients
    accumulate with exact token-mean scaling (accumulate_gradients), then one clipped optimizer step (skipped
    on a non-finite norm); the lr schedule steps once per update. `after_first_accumulate` runs after the
    first mini-batch's gradients, before its optimizer step (the actor measures the rollout mismatch there).
    Returns the statistics averaged over the optimizer steps, with {role}/grad_norm, lr, num_skipped_steps."""
    from tinyzero.workers.batching import make_micro_batches

    cfg = trained.config
    trained.model.train()
    params = trained.optimizer_params()
    stats_sum = torch.zeros(len(stat_names), dtype=torch.float64)
    steps = []  # (grad_norm, stepped) of each optimizer step
    for epoch in range(cfg.ppo_epochs):
        seed = cfg.seed + 1000003 * trained.num_updates + epoch
        for mini in mini_batches(data, rows_per_mini_batch, cfg.shuffle, seed):
            micros, _ = make_micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                           cfg.ppo_max_token_len_per_gpu, trained.dp_group, trained.packing)
            trained.optimizer.zero_grad(set_to_none=True)
            stats_sum += accumulate_gradients(micros, mini.batch["response_mask"], cfg.loss_agg_mode, micro_loss,
                                              stat_kinds, trained.device, trained.dp_size, trained.dp_group)
            if after_first_accumulate is not None and not steps:
                after_first_accumulate()
            steps.append(optimizer_step(trained.optimizer, params, cfg.grad_clip, role))
    lr = step_scheduler(trained.lr_scheduler) if trained.lr_scheduler is not None else cfg.optim.lr
    trained.num_updates += 1
    metrics = {name: float(v) / len(steps) for name, v in zip(stat_names, stats_sum.tolist())}
    metrics.update(update_step_metrics(role, steps, lr))
    return metrics


def mini_batches(data: DataProto, rows_per_rank: int, shuffle: bool, seed: int) -> list[DataProto]:
    """Split a rank's rows into mini-batches of `rows_per_rank` rows (optionally shuffled)."""
    n = len(data)
    if rows_per_rank <= 0 or n % rows_per_rank:
        raise ValueError(f"a rank holds {n} rows, not a multiple of its mini-batch of {rows_per_rank} rows; "
                         f"make the train batch (times rollout.n) divisible by ppo_mini_batch_size (times "
                         f"rollout.n) and the mini-batch by the number of data-parallel ranks")
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        data = data.select_idxs(order)
    return data.split(rows_per_rank)


def accumulate_gradients(micros: Sequence[DataProto], mini_mask: torch.Tensor, loss_agg_mode: str,
                         micro_loss_fn: Callable[[dict], tuple[torch.Tensor, Sequence[torch.Tensor]]],
                         stat_kinds: Sequence[str], device: torch.device, dp_size: int = 1,
                         dp_group=None) -> torch.Tensor:
    """Backward every micro-batch with its exact share of the mini-batch loss.

    `micro_loss_fn(batch)` returns (loss normalised over the micro-batch by agg_loss, stats).
    A stat of kind "loss" is weighted like the loss, one of kind "token" as a token-mean.
    Returns the mini-batch statistics summed over the data-parallel group (float64, CPU).
    """
    counts = global_counts(mini_mask, dp_group)
    stats = torch.zeros(len(stat_kinds), dtype=torch.float64, device=device)
    # No host sync per micro-batch: the weights come from the CPU masks, the stats accumulate on the
    # device (scaled by Python floats, no host-to-device tensor), the inputs are queued without waiting.
    for micro in micros:
        report_progress("update_micro_batch", micro_batches=len(micros))
        batch = {k: v.to(device, non_blocking=True) for k, v in micro.batch.items()}
        mask = micro.batch["response_mask"]
        w = micro_weight(loss_agg_mode, mask, counts)
        tw = token_weight(mask, counts)
        loss, parts = micro_loss_fn(batch)
        # FSDP averages gradients over its dp_size ranks; the factor undoes that division.
        (loss * (w * dp_size)).backward()
        stats += torch.stack([p.detach().to(torch.float64).reshape(()) * (w if kind == "loss" else tw)
                              for p, kind in zip(parts, stat_kinds)])
    all_reduce_sum(stats, dp_group)
    return stats.cpu()


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Pre-clip global L2 norm (a plain scalar tensor); clips only when the norm is finite."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(norm, "full_tensor"):  # FSDP2 DTensor grads give a DTensor norm
        norm = norm.full_tensor()
    if torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def optimizer_step(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], grad_clip: float,
                   role: str) -> tuple[float, bool]:
    """Clip and step; a non-finite gradient norm skips the step. Returns (grad_norm, stepped)."""
    grad_norm = float(clip_grad_norm(params, grad_clip))
    stepped = math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
    else:
        logger.warning("%s: gradient norm is %s; optimizer step skipped", role, grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def update_step_metrics(role: str, steps: Sequence[tuple[float, bool]], lr: float) -> dict[str, float]:
    """{role}/grad_norm (mean of the finite norms), {role}/lr and {role}/num_skipped_steps (steps a
    non-finite norm skipped) of one update's optimizer_step results."""
    return {f"{role}/grad_norm": mean_finite([norm for norm, _ in steps]), f"{role}/lr": lr,
            f"{role}/num_skipped_steps": float(sum(not stepped for _, stepped in steps))}


def mean_finite(values: Sequence[float]) -> float:
    """Mean of the finite values (nan when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def step_scheduler(lr_scheduler) -> float:
    """Step the lr schedule once per update call; return the lr that call used."""
    if lr_scheduler is None:
        return float("nan")
    lr = lr_scheduler.get_last_lr()[0]
    with warnings.catch_warnings():
        # After a skipped (non-finite) optimizer step torch warns about the call order; the
        # schedule still advances once per update, as intended.
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        lr_scheduler.step()
    return lr
