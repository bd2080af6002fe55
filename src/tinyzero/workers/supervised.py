"""Single-model training on FSDP2 (SFT, reward model): a worker with a loss, and a short driver loop.

    wg = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=ClassWithInitArgs(
        SupervisedWorker, cfg.actor_rollout_ref, "sft"))
    wg.init_model()
    metrics = wg.train_step(batch)        # one optimizer step on the global batch (rows split over ranks)

Losses are exact under data parallelism: each rank's sum is divided by the global count (of
response tokens for SFT, of pairs for the RM), and FSDP's gradient averaging is undone by the
world-size factor, so N ranks compute what one rank would on the whole batch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tinyzero.distributed.parallel_dims import ParallelDims
from tinyzero.protocol import DataProto
from tinyzero.single_controller import Dispatch, Worker, register
from tinyzero.workers import checkpointing
from tinyzero.workers.common import prepare_role_model, reshard
from tinyzero.workers.config import role_layout
from tinyzero.workers.forward import pack_batch, response_log_probs
from tinyzero.workers.optim import build_lr_scheduler, build_optimizer
from tinyzero.workers.packing import packing_mode
from tinyzero.workers.scaling import all_reduce_sum
from tinyzero.workers.update import optimizer_step


def sft_loss_sums(model, batch: dict, packing: str = "none") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(summed NLL over the target tokens, {"count": targets}) for one micro-batch.

    Token t + 1 is a target where loss_mask[t + 1] is 1; its log-prob comes from the hidden state at t
    through the fused lm_head kernel (tinyzero.workers.forward: no (tokens, vocab) logits are built).
    The rows are right-padded, so they go to `response_log_probs` as one-token prompts followed by
    (T - 1)-token responses. Packed (`packing` other than "none"), every row is one segment of packed
    rows and only the targets' hidden states meet the lm_head."""
    ids = batch["input_ids"]
    targets = sft_targets(batch)
    rows = {"input_ids": ids, "attention_mask": batch["attention_mask"], "position_ids": batch["position_ids"],
            "responses": ids[:, 1:]}
    if packing == "none":
        log_probs, _ = response_log_probs(model, rows, 1.0, False)
    else:
        packed, mask = pack_batch(model, rows, "remove_padding")
        packed.keep_only(targets)
        log_probs = model.token_log_probs(packed.input_ids, mask, packed.position_ids, rows["responses"], 1.0,
                                          False, packed)
    return -(log_probs * targets).sum(), {"count": targets.sum()}


def rm_scores(model, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(b,) scalar reward at each row's last attended token."""
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    if out.dim() == 3:  # token-level head (b, T, 1): read the last attended position
        last = (torch.arange(attn.shape[1], device=attn.device) * attn).argmax(-1)
        out = out[torch.arange(len(last), device=attn.device), last]
    return out.reshape(-1).float()


def rm_loss_sums(model, batch: dict, packing: str = "none") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(summed -log sigmoid(r_chosen - r_rejected), {"count": pairs, "correct": pairs ranked right})."""
    chosen = rm_scores(model, batch["chosen_input_ids"], batch["chosen_attention_mask"],
                       batch["chosen_position_ids"])
    rejected = rm_scores(model, batch["rejected_input_ids"], batch["rejected_attention_mask"],
                         batch["rejected_position_ids"])
    margin = chosen - rejected  # (b,)
    return -F.logsigmoid(margin).sum(), {"count": torch.tensor(float(len(margin))),
                                         "correct": (margin > 0).float().sum().detach()}


def sft_targets(batch: dict) -> torch.Tensor:
    """(b, T-1) bool: token t + 1 is a target (a real token whose loss_mask is 1)."""
    return batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, 1:].bool()


def sft_count(batch: dict) -> float:
    return float(sft_targets(batch).sum())


def rm_count(batch: dict) -> float:
    return float(len(batch["chosen_input_ids"]))


# mode -> (loss sums of a micro-batch, what the loss is averaged over, model kind)
LOSSES = {"sft": (sft_loss_sums, sft_count, "causal_lm"), "rm": (rm_loss_sums, rm_count, "reward")}


class SupervisedWorker(Worker):
    """One trainable model and a loss from LOSSES; the model/optim/fsdp settings of actor_rollout_ref."""

    def __init__(self, config, mode: str, dims: ParallelDims | None = None):
        """`dims` comes from the run plan (tinyzero.plan), which also checks that it is data-parallel only;
        a worker built outside a run derives it from the actor's settings."""
        super().__init__()
        if mode not in LOSSES:
            raise ValueError(f"mode={mode!r}: use one of {sorted(LOSSES)}")
        self.config = config
        self.dims = role_layout(config.actor, self.world_size) if dims is None else dims
        self.mode = mode
        self.loss_fn, self.count_fn, self.kind = LOSSES[mode]
        self.model = self.optimizer = self.lr_scheduler = self.tokenizer = None
        self.num_updates = 0
        self.packing = "none"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from tinyzero.models.loading import load_tokenizer

        cfg = self.config
        self.tokenizer = load_tokenizer(cfg.model.resolved_tokenizer_path, cfg.model.trust_remote_code)
        fsdp = cfg.actor.fsdp_config
        if self.mode == "sft":
            # Packing applies to SFT's log-probs; the reward model's scores stay padded.
            self.packing = "remove_padding" if packing_mode(cfg.model) != "none" else "none"
        self.model = prepare_role_model(self, cfg.model, fsdp, self.dims, self.kind, packing=self.packing,
                                        forward_methods=self.mode == "sft")
        self.optimizer = build_optimizer(self.model.parameters(), cfg.actor.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.actor.optim)

    def _micro_batches(self, data: DataProto) -> list[DataProto]:
        mbs = self.config.actor.ppo_micro_batch_size_per_gpu
        return data.split(mbs) if mbs else [data]

    def _run(self, data: DataProto, train: bool) -> dict[str, float]:
        """Sum the loss over micro-batches (backward each when training); return global means."""
        micros = self._micro_batches(data)
        batches = [{k: v.to(self.device) for k, v in m.batch.items()} for m in micros]
        count = torch.tensor([sum(self.count_fn(b) for b in batches)], dtype=torch.float64)
        total = all_reduce_sum(count, self.process_group).item()
        sums = torch.zeros(3, dtype=torch.float64)  # loss, count, correct
        for b in batches:
            with torch.set_grad_enabled(train):
                loss_sum, stats = self.loss_fn(self.model, b, self.packing)
            if train:
                (loss_sum * (self.world_size / max(total, 1.0))).backward()
            sums += torch.tensor([loss_sum.item(), float(stats["count"]), float(stats.get("correct", 0.0))],
                                 dtype=torch.float64)
        all_reduce_sum(sums, self.process_group)
        prefix = "train" if train else "val"
        out = {f"{prefix}/loss": sums[0].item() / max(sums[1].item(), 1.0)}
        if self.mode == "rm":
            out[f"{prefix}/acc"] = sums[2].item() / max(sums[1].item(), 1.0)
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def train_step(self, data: DataProto) -> DataProto:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self._run(data, train=True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm, stepped = optimizer_step(self.optimizer, params, self.config.actor.grad_clip, self.mode)
        metrics["train/lr"] = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        self.num_updates += 1
        metrics.update({"train/grad_norm": grad_norm, "train/num_skipped_steps": float(not stepped)})
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def eval_step(self, data: DataProto) -> DataProto:
        self.model.eval()
        metrics = self._run(data, train=False)
        reshard(self.model)  # a forward without backward leaves the root unit gathered
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0):
        checkpointing.save_role(self, self, local_path, global_step, ["model", "optimizer", "extra"])
        return local_path

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str):
        checkpointing.load_role(self, self, local_path)
        return local_path

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> str:
        os.makedirs(out_dir, exist_ok=True)
        return checkpointing.export_hf(self, self.model, out_dir, self.tokenizer)
