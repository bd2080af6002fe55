"""The PPO policy computations of one data-parallel rank: log-probs and the policy update.

`PPOActor` holds a (usually FSDP2-sharded) causal LM, its optimizer and lr scheduler, and
the data-parallel process group. `update_policy` runs ppo_epochs x mini-batches x
micro-batches with gradient accumulation; each micro-batch loss is scaled by its exact
share of the mini-batch loss (see tinyzero.workers.scaling), so one optimizer step's
gradient does not depend on how the mini-batch is split over micro-batches and ranks.
Metrics are mini-batch values reduced over the data-parallel group, averaged over the
optimizer steps of the call.

Where old log-probs come from (`data.meta_info["old_log_probs_source"]`, set by the trainer):
- "actor" (default): the batch carries `old_log_probs` from a compute_log_prob pass.
- "update": the update is strictly on-policy (one epoch, one mini-batch: a single optimizer
  step), so the old policy is the current one and old log-probs are the update's own,
  detached; the ratio is exactly 1 and no separate pass is needed. Checked here: anything but
  one optimizer step is an error.
- "rollout": veRL's bypass mode; the sampler's `rollout_log_probs` serve as old log-probs.
In the last two the update reports actor/entropy from its own forward and, when the batch has
rollout_log_probs, the rollout/trainer mismatch metrics the trainer logs otherwise
(training/rollout_*, tinyzero.algorithms.rollout_mismatch_metrics) from the log-probs of its first
mini-batch, before any optimizer step (the compute_log_prob pass that measures them does not run).

`packing` ("none", "remove_padding", "shared_prefix"; the constructor's, from the model config)
selects the packed forward of tinyzero.workers.packing for every pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyzero.protocol import DataProto
from tinyzero.workers.batching import make_micro_batches, restore_order
from tinyzero.workers.common import TrainedModel, reshard
from tinyzero.workers.config import ActorConfig
from tinyzero.workers.forward import response_log_probs
from tinyzero.workers.update import run_update

# The per-mini-batch statistics (reduced with one all-reduce) and how each is weighted.
_STAT_NAMES = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower",
               "actor/entropy", "actor/kl_loss", "actor/distill_loss")
_STAT_KINDS = ("loss", "token", "token", "token", "loss", "loss", "loss")
OLD_LOG_PROB_SOURCES = ("actor", "update", "rollout")


class PPOActor(TrainedModel):
    """Log-probs and PPO updates of one rank's share of the batch."""

    config: ActorConfig
    _seen: list | None = None  # (log-prob, rollout log-prob, mask) stacks of the first mini-batch

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, micro_batch_size: int | None, use_dynamic_bsz: bool,
                         max_token_len: int, temperature: float, calculate_entropy: bool = True):
        """(log_probs, entropys or None), each (rows, R) fp32 on CPU, in the rows' order."""
        self.model.eval()
        keys = ["responses", "input_ids", "attention_mask", "position_ids"]
        data = data.select(batch_keys=keys)
        micros, parts = make_micro_batches(data, micro_batch_size, use_dynamic_bsz, max_token_len, self.dp_group,
                                           self.packing)
        log_probs, entropys = [], []
        for micro in micros:  # results stay on the device until the last micro-batch: one copy back, one sync
            batch = {k: v.to(self.device, non_blocking=True) for k, v in micro.batch.items()}
            lp, ent = response_log_probs(self.model, batch, temperature, calculate_entropy, self.packing)
            log_probs.append(lp.float())
            if ent is not None:
                entropys.append(ent.float())
        reshard(self.model)
        log_probs = restore_order(torch.cat(log_probs).cpu(), parts)
        entropy = restore_order(torch.cat(entropys).cpu(), parts) if calculate_entropy else None
        return log_probs, entropy

    # ------------------------------------------------------------------ update
    def _micro_loss(self, batch: dict, temperature: float, source: str = "actor", distill: dict | None = None):
        """Loss of one micro-batch (agg_loss-normalised over the micro-batch) and its stats. `distill`
        ({"coef", "kl_type"}, on-policy distillation's "loss" mode) adds coef * KL(student || teacher)."""
        from tinyzero.algorithms import agg_loss, get_policy_loss_fn, kl_penalty

        cfg = self.config
        mask = batch["response_mask"].float()  # (b, R)
        need_entropy = cfg.entropy_coeff != 0 or source != "actor"
        log_prob, entropy = response_log_probs(self.model, batch, temperature, need_entropy, self.packing)
        if self._seen is not None:
            self._seen.append(torch.stack([log_prob.detach(), batch["rollout_log_probs"].float(), mask]))  # (3, b, R)
        if not bool(mask.any()):
            # No valid token: the losses are 0/0. A zero loss still runs backward (FSDP collectives).
            zero = log_prob.sum() * 0.0
            return zero, (zero,) * len(_STAT_NAMES)
        old_log_prob = {"actor": batch.get("old_log_probs"), "update": log_prob.detach(),
                        "rollout": batch.get("rollout_log_probs")}[source]
        zero = torch.zeros((), device=log_prob.device)
        policy_loss_fn = get_policy_loss_fn(cfg.policy_loss.loss_mode)
        rollout_log_probs = batch.get("rollout_log_probs") if cfg.tis_imp_ratio_cap > 0 else None
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = policy_loss_fn(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=batch["advantages"],
            response_mask=mask, loss_agg_mode=cfg.loss_agg_mode, config=cfg, rollout_log_probs=rollout_log_probs,
        )
        loss = pg_loss
        entropy_loss = zero
        if need_entropy:
            entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode)
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * entropy_loss
        kl_loss = zero
        if cfg.use_kl_loss:
            kld = kl_penalty(log_prob, batch["ref_log_prob"], cfg.kl_loss_type)  # (b, R)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl_loss
        distill_loss = zero
        if distill is not None:
            kld = kl_penalty(log_prob, batch["teacher_log_prob"], distill["kl_type"])  # (b, R)
            distill_loss = agg_loss(kld, mask, cfg.loss_agg_mode)
            loss = loss + distill["coef"] * distill_loss
        return loss, (pg_loss, clipfrac, ppo_kl, clipfrac_lower, entropy_loss, kl_loss, distill_loss)

    def _mismatch_metrics(self) -> dict[str, float]:
        """training/rollout_* over the rows of all ranks seen by the first mini-batch's forwards."""
        from tinyzero.algorithms import rollout_mismatch_metrics

        seen = torch.cat(self._seen, dim=1) if self._seen else torch.zeros(3, 0, 0, device=self.device)
        self._seen = None
        if self.dp_group is not None and dist.is_initialized() and dist.get_world_size(self.dp_group) > 1:
            # Ranks hold the same number of rows (a mini-batch each) of the same width.
            parts = [torch.empty_like(seen) for _ in range(dist.get_world_size(self.dp_group))]
            dist.all_gather(parts, seen.contiguous(), group=self.dp_group)
            seen = torch.cat(parts, dim=1)
        cap = self.config.tis_imp_ratio_cap
        out = rollout_mismatch_metrics(seen[0], seen[1], seen[2], cap if cap > 0 else None)
        return {k: float(v) for k, v in out.items()}

    def _batch_keys(self, data: DataProto, source: str) -> list[str]:
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "response_mask", "advantages"]
        if source == "actor":
            keys.append("old_log_probs")
        if self.config.use_kl_loss:
            keys.append("ref_log_prob")
        if "distill_loss" in data.meta_info:
            keys.append("teacher_log_prob")
        if self.config.tis_imp_ratio_cap > 0 or source == "rollout" or (
                source == "update" and "rollout_log_probs" in data.batch):
            keys.append("rollout_log_probs")
        return keys

    def _old_log_prob_source(self, data: DataProto, rows_per_mini_batch: int) -> str:
        source = data.meta_info.get("old_log_probs_source", "actor")
        if source not in OLD_LOG_PROB_SOURCES:
            raise ValueError(f"meta_info old_log_probs_source={source!r} is unknown; use one of "
                             f"{list(OLD_LOG_PROB_SOURCES)}")
        steps = self.config.ppo_epochs * (len(data) // max(rows_per_mini_batch, 1))
        if source == "update" and steps != 1:
            raise ValueError(f"old log-probs from the update itself need exactly one optimizer step, but "
                             f"ppo_epochs={self.config.ppo_epochs} and {len(data)} rows in mini-batches of "
                             f"{rows_per_mini_batch} give {steps}; run compute_log_prob first")
        return source

    def update_policy(self, data: DataProto, rows_per_mini_batch: int) -> dict[str, float]:
        """PPO update over `data` (this rank's rows); returns metrics reduced over the DP group."""
        cfg = self.config
        temperature = float(data.meta_info.get("temperature", 1.0))
        source = self._old_log_prob_source(data, rows_per_mini_batch)
        distill = data.meta_info.get("distill_loss")  # {"coef", "kl_type"} in distillation's "loss" mode
        keys = self._batch_keys(data, source)
        missing = [k for k in keys if k not in data.batch]
        if missing:
            raise ValueError(f"update_actor: batch lacks {missing} (use_kl_loss needs ref_log_prob; "
                             f"tis_imp_ratio_cap > 0 and use_rollout_log_probs need rollout_log_probs)")
        data = data.select(batch_keys=keys)
        measure = source != "actor" and "rollout_log_probs" in data.batch
        self._seen = [] if measure else None
        mismatch = {}

        def measure_mismatch():  # before the first optimizer step only
            mismatch.update(self._mismatch_metrics())

        metrics = run_update(self, data, rows_per_mini_batch,
                             lambda batch: self._micro_loss(batch, temperature, source, distill), _STAT_NAMES,
                             _STAT_KINDS, "actor", measure_mismatch if measure else None)
        metrics.update(mismatch)
        if cfg.entropy_coeff == 0 and source == "actor":
            metrics.pop("actor/entropy")
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        else:
            metrics.pop("actor/kl_loss")
        if distill is None:
            metrics.pop("actor/distill_loss")
        return metrics
