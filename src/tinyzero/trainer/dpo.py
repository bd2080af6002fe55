"""DPO: direct preference optimisation on a pairwise parquet, as a short driver over the PPO roles.

    torchrun --nproc_per_node 8 train.py dpo --preset dpo --data.train_files data/prefs/train.parquet \
        --actor_rollout_ref.model.path /models/Qwen2.5-0.5B-Instruct --dpo.beta 0.1

This is the framework's example of a new algorithm built from existing parts: no new worker.
The policy is an `ActorRolloutRefWorker` with role "actor", the frozen reference one with role
"ref", colocated on every rank. A step is

    batch = pairs_to_rows(pairs)                       # row 2i: chosen, row 2i+1: rejected
    batch = batch.union(ref_wg.compute_ref_log_prob(batch))
    batch = batch.union(actor_wg.compute_log_prob(batch))        # for the reward metrics
    actor_wg.update_actor(batch)                        # policy loss "dpo" from the registry

The loss is registered in the policy-loss registry of `tinyzero.algorithms`, so the actor's
update (micro-batching, exact loss scaling over ranks, grad clipping, non-finite guard) is
reused as is. In the policy-loss interface the log-probs a loss measures the policy against
arrive as `old_log_prob`; for DPO that anchor is the reference, so the driver puts the
reference log-probs there, and `advantages` carries the preference sign (+1 chosen,
-1 rejected) on every token. With h = (log pi/ref)(chosen) - (log pi/ref)(rejected), summed
over response tokens, the loss is
    sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)     (eps: label smoothing)
    ipo:     (h - 1 / (2 beta))^2
averaged over pairs. Metrics follow TRL: {train,val}/rewards/chosen|rejected|margins|accuracies,
with rewards = beta * (log pi - log ref) summed over the response.
"""

from __future__ import annotations

from operator import attrgetter

import torch
import torch.nn.functional as F

from tinyzero.algorithms import register_policy_loss
from tinyzero.config import Config
from tinyzero.config.overrides import override
from tinyzero.data import PairwiseDataset
from tinyzero.distributed import get_world_size
from tinyzero.protocol import DataProto
from tinyzero.single_controller import (
    ClassWithInitArgs,
    ResourcePool,
    WorkerGroup,
    create_colocated_worker_cls,
)
from tinyzero.trainer.loggers import Tracking
from tinyzero.trainer.loop import pop_metrics
from tinyzero.trainer.setup import make_tracker, plan_and_check, prepare_run, write_run_config
from tinyzero.trainer.sft import SupervisedTrainer
from tinyzero.workers.actor_worker import ActorRolloutRefWorker

LOSS_NAME = "dpo"

# The actor settings DPO runs on (field, value, why); a different user value is replaced with a warning.
DPO_SETTINGS = (
    ("actor_rollout_ref.rollout.n", 2,
     "DPO's actor sees a chosen and a rejected row per pair, so its mini-batch is ppo_mini_batch_size pairs"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode", LOSS_NAME, "DPO trains with the registered dpo loss"),
    ("actor_rollout_ref.actor.loss_agg_mode", "seq-mean-token-mean",
     "every row counts once, so micro-batch shares are pair shares"),
    ("actor_rollout_ref.actor.use_kl_loss", False, "the DPO loss holds the reference already"),
    ("actor_rollout_ref.actor.entropy_coeff", 0.0, "DPO has no entropy bonus"),
    ("actor_rollout_ref.actor.ppo_epochs", 1, "one optimizer pass per batch of pairs"),
)


def dpo_pair_loss(h: torch.Tensor, beta: float, label_smoothing: float, loss_type: str) -> torch.Tensor:
    """(pairs,) DPO losses from h = chosen minus rejected policy/reference log-ratio (pairs,)."""
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    return -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def make_dpo_policy_loss(beta: float, label_smoothing: float, loss_type: str):
    """A policy loss (registry signature) for interleaved (chosen, rejected) rows of one micro-batch."""

    def dpo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                        config=None, rollout_log_probs=None):
        mask = response_mask.float()  # (rows, R)
        if log_prob.shape[0] % 2:
            raise ValueError("DPO: a micro-batch holds an odd number of rows; chosen and rejected rows must pair up")
        log_ratio = ((log_prob - old_log_prob) * mask).sum(-1)  # (rows,)
        sign = advantages[:, 0]  # (rows,): +1 chosen, -1 rejected
        h = (sign * log_ratio).view(-1, 2).sum(-1)  # (pairs,)
        loss = dpo_pair_loss(h, beta, label_smoothing, loss_type).mean()
        zero = torch.zeros((), device=loss.device)
        return loss, zero, zero, zero

    return dpo_policy_loss


def pairs_to_rows(pairs: DataProto) -> DataProto:
    """Pairwise batch (chosen_* / rejected_* right-padded sequences) -> interleaved policy rows.

    Each sequence becomes a row whose "prompt" is its first token and whose "response" is the
    rest, so the actor's log-prob of response token t is that of sequence token t + 1; the
    response mask keeps only the answer tokens (the dataset's loss mask).
    """
    b = pairs.batch
    rows = {}
    for key in ("input_ids", "attention_mask", "position_ids", "loss_mask"):
        rows[key] = torch.stack([b[f"chosen_{key}"], b[f"rejected_{key}"]], dim=1).flatten(0, 1)  # (2B, L)
    ids = rows["input_ids"]
    mask = rows.pop("loss_mask")[:, 1:].float() * rows["attention_mask"][:, 1:].float()  # (2B, L-1)
    if bool((mask.sum(-1) == 0).any()):
        raise ValueError("DPO: a chosen or rejected response has no tokens after truncation; raise data.max_length")
    sign = torch.tensor([1.0, -1.0]).repeat(len(pairs))  # (2B,)
    rows.update(responses=ids[:, 1:], response_mask=mask, advantages=sign[:, None].expand_as(mask).contiguous())
    return DataProto.from_dict(tensors=rows, meta_info={"temperature": 1.0})


def reward_metrics(batch: DataProto, beta: float, prefix: str) -> dict[str, float]:
    """TRL's DPO metrics from policy (old_log_probs) and reference (ref_log_prob) log-probs."""
    b = batch.batch
    mask = b["response_mask"].float()
    rewards = (beta * ((b["old_log_probs"] - b["ref_log_prob"]) * mask).sum(-1)).view(-1, 2).double()  # (pairs, 2)
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    return {f"{prefix}/rewards/chosen": float(chosen.mean()), f"{prefix}/rewards/rejected": float(rejected.mean()),
            f"{prefix}/rewards/margins": float((chosen - rejected).mean()),
            f"{prefix}/rewards/accuracies": float((chosen > rejected).double().mean())}


class DPOTrainer(SupervisedTrainer):
    """SupervisedTrainer's loop (data, validation, checkpoints, export) with a DPO step over two roles."""

    def __init__(self, config: Config, actor_wg, ref_wg, loader, val_dataset, tracker: Tracking, total_steps: int):
        super().__init__(config, actor_wg, loader, val_dataset, tracker, total_steps)
        self.ref_wg = ref_wg

    def _score(self, pairs: DataProto, prefix: str) -> tuple[DataProto, dict[str, float]]:
        batch = pairs_to_rows(pairs)
        batch = batch.union(self.ref_wg.compute_ref_log_prob(batch))
        old = self.wg.compute_log_prob(batch)
        old.meta_info.pop("metrics", None)
        batch = batch.union(old)
        metrics = reward_metrics(batch, self.config.dpo.beta, prefix)
        return batch, metrics

    def train_step(self, pairs: DataProto) -> dict[str, float]:
        batch, metrics = self._score(pairs, "train")
        batch.batch["old_log_probs"] = batch.batch["ref_log_prob"]  # the anchor of the DPO log-ratio
        out = pop_metrics(self.wg.update_actor(batch))
        metrics.update({"train/loss": out["actor/pg_loss"], "train/grad_norm": out["actor/grad_norm"],
                        "train/lr": out["actor/lr"], "train/num_skipped_steps": out["actor/num_skipped_steps"]})
        return metrics

    def eval_step(self, pairs: DataProto) -> dict[str, float]:
        batch, metrics = self._score(pairs, "val")
        b = batch.batch
        h = ((b["old_log_probs"] - b["ref_log_prob"]) * b["response_mask"]).sum(-1) * b["advantages"][:, 0]
        dpo = self.config.dpo
        losses = dpo_pair_loss(h.view(-1, 2).sum(-1).double(), dpo.beta, dpo.label_smoothing, dpo.loss_type)
        metrics["val/loss"] = float(losses.mean())
        return metrics


def build_dpo_trainer(cfg: Config) -> DPOTrainer:
    """Datasets, the colocated actor + reference groups, loggers; every rank."""
    world_size = get_world_size()
    plan = plan_and_check(cfg, world_size)
    user_cfg, cfg = cfg, plan.config  # the DPO settings below go into the resolved copy
    arr = cfg.actor_rollout_ref
    # every row counts once, so micro-batch shares are pair shares; the registry entry says so too
    register_policy_loss(LOSS_NAME, loss_agg_mode="seq-mean-token-mean", replace=True)(
        make_dpo_policy_loss(cfg.dpo.beta, cfg.dpo.label_smoothing, cfg.dpo.loss_type))
    for field, new, why in DPO_SETTINGS:
        section, name = field.rsplit(".", 1)
        obj = attrgetter(section.removeprefix("actor_rollout_ref."))(arr)
        override(obj, name, new, field, why)

    run = prepare_run(cfg, PairwiseDataset, {"actor_rollout_ref.actor.optim": arr.actor.optim})
    run_dir = write_run_config(user_cfg, plan)
    dims = {"actor": plan.dims["actor"], "ref": plan.dims["ref"]}
    classes = {"actor": ClassWithInitArgs(ActorRolloutRefWorker, arr, "actor", dims=dims),
               "ref": ClassWithInitArgs(ActorRolloutRefWorker, arr, "ref", dims=dims)}
    pool = ResourcePool(ranks=list(plan.pools["actor"]))
    wgs = WorkerGroup(resource_pool=pool, cls_with_init=create_colocated_worker_cls(classes)).spawn(
        prefix_set=set(classes))
    wgs["ref"].init_model()
    wgs["actor"].init_model()
    tracker = make_tracker(cfg, run_dir, run.total_steps)
    return DPOTrainer(cfg, wgs["actor"], wgs["ref"], run.train_loader, run.val_dataset, tracker, run.total_steps)
