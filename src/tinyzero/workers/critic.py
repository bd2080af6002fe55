"""The value-function computations of one data-parallel rank: values and the critic update.

`PPOCritic` holds a value model (LM backbone + scalar head, usually FSDP2-sharded), its
optimizer and lr scheduler. The update minimises the clipped value loss of
tinyzero.algorithms.compute_value_loss with the same exact micro-batch / rank scaling as
the actor (tinyzero.workers.scaling). `packing` (the constructor's, from the model config)
selects the packed forward of tinyzero.workers.packing for values and updates.
"""

from __future__ import annotations

import torch

from tinyzero.protocol import DataProto
from tinyzero.workers.batching import make_micro_batches, restore_order
from tinyzero.workers.common import TrainedModel, reshard
from tinyzero.workers.config import CriticConfig
from tinyzero.workers.forward import response_values
from tinyzero.workers.update import run_update

_STAT_NAMES = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")
_STAT_KINDS = ("loss", "token", "token")
_FORWARD_KEYS = ["responses", "input_ids", "attention_mask", "position_ids"]


class PPOCritic(TrainedModel):
    """Values and value-loss updates of one rank's share of the batch."""

    config: CriticConfig

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values (rows, R) fp32 on CPU at the response positions, masked by response_mask."""
        cfg = self.config
        self.model.eval()
        keys = _FORWARD_KEYS + (["response_mask"] if "response_mask" in data.batch else [])
        data = data.select(batch_keys=keys)
        micros, parts = make_micro_batches(data, cfg.forward_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                           cfg.forward_max_token_len_per_gpu, self.dp_group, self.packing)
        values = []
        for micro in micros:  # results stay on the device until the last micro-batch: one copy back, one sync
            batch = {k: v.to(self.device, non_blocking=True) for k, v in micro.batch.items()}
            values.append(response_values(self.model, batch, self.packing))
        reshard(self.model)
        values = restore_order(torch.cat(values).cpu(), parts)
        if "response_mask" in data.batch:
            values = values * data.batch["response_mask"].to(values.dtype)
        return values

    def _micro_loss(self, batch: dict):
        from tinyzero.algorithms import compute_value_loss, masked_mean

        cfg = self.config
        mask = batch["response_mask"].float()  # (b, R)
        vpreds = response_values(self.model, batch, self.packing)  # (b, R)
        if not bool(mask.any()):
            zero = vpreds.sum() * 0.0  # no valid token: a zero loss still runs backward
            return zero, (zero,) * 3
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds=vpreds, returns=batch["returns"], values=batch["values"], response_mask=mask,
            cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode)
        return vf_loss, (vf_loss, vf_clipfrac, masked_mean(vpreds, mask))

    def update_critic(self, data: DataProto, rows_per_mini_batch: int) -> dict[str, float]:
        """Value-loss update over `data` (this rank's rows); metrics reduced over the DP group."""
        keys = _FORWARD_KEYS + ["response_mask", "values", "returns"]
        missing = [k for k in keys if k not in data.batch]
        if missing:
            raise ValueError(f"update_critic: batch lacks {missing} (compute_values and compute_advantage "
                             f"must run first)")
        data = data.select(batch_keys=keys)
        return run_update(self, data, rows_per_mini_batch, self._micro_loss, _STAT_NAMES, _STAT_KINDS, "critic")
