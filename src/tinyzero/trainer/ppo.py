"""The PPO-family trainer: one step is rollout -> score -> advantages -> critic update -> actor update.

Every rank runs this loop on the same replicated batch (SPMD); worker-group calls dispatch
shares of it to the roles and hand every rank the gathered result (see single_controller).
The estimator (GAE with a critic, GRPO, RLOO, REINFORCE++, ...) comes from the
`tinyzero.algorithms` registry, so this file has no per-algorithm branches beyond "is there
a critic / a reference / a reward model".

    trainer = build_ppo_trainer(cfg)     # tinyzero.trainer.builder
    trainer.fit()
"""

from __future__ import annotations

import numpy as np
import torch

from tinyzero.algorithms.advantages import compute_advantage, get_adv_estimator_spec
from tinyzero.algorithms.distill import apply_distillation
from tinyzero.algorithms.dynamic_sampling import FILTER_METRICS, filter_groups
from tinyzero.algorithms.kl import apply_kl_penalty, get_kl_controller
from tinyzero.protocol import DataProto
from tinyzero.trainer.balance import balance_batch
from tinyzero.trainer.checkpoint import load_rng_state, save_rng_state
from tinyzero.trainer.dumps import dump_batch, extra_info_rows
from tinyzero.trainer.loop import (
    Driver,
    NonFiniteError,  # noqa: F401 - its former home, still imported from here
    pop_metrics,
)
from tinyzero.trainer.metrics import (
    compute_data_metrics,
    compute_mfu_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    max_memory_allocated_gb,
    merge_worker_metrics,
    timer,
)
from tinyzero.trainer.validation import validate

GEN_KEYS = ("input_ids", "attention_mask", "position_ids")
GEN_NON_TENSOR_KEYS = ("raw_prompt_ids",)


class PPOTrainer(Driver):
    """Drives the roles through PPO steps; owns the step counter, KL controller, logging, checkpoints."""

    def __init__(self, config, roles, tokenizer, train_loader, val_dataset, reward_fn, val_reward_fn, tracker,
                 total_steps: int, world_size: int, device: torch.device):
        super().__init__(config, train_loader, val_dataset, tracker, total_steps)
        self.roles = roles  # .actor_rollout (always), .critic, .reward_model (or None)
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.world_size = world_size
        self.device = device
        self.kl_ctrl = get_kl_controller(config.algorithm.kl_ctrl)
        self.hf_config = None  # the policy's HF config (set by the builder): perf/mfu/actor on GPU

    # ------------------------------------------------------------------ one step (Driver.fit runs the loop)
    def step(self) -> dict[str, float]:
        """rollout -> score -> advantages -> critic update -> actor update; the step's metrics."""
        metrics, timing = {}, {}
        with timer("step", timing):
            if self.config.algorithm.filter_groups.enable:
                batch = self.rollout_filtered(timing, metrics)  # DAPO: generate and score until full
            else:
                batch = self.rollout(self.next_batch(), timing, metrics)
            batch = self.score(batch, timing, metrics)
            batch = self.compute_advantages(batch, timing, metrics)
            self.update_models(batch, timing, metrics)
            self.dump_rollout(batch, timing)
        metrics.update(self.step_metrics(batch, timing))
        return metrics

    def next_batch(self, part: int = 0) -> DataProto:
        """The next prompt batch (epochs roll over inside; resumable through the loader's state).

        `part` numbers the prompt batches of one step (dynamic sampling draws several): uids stay unique."""
        batch = self.next_train_batch()
        prefix = f"{self.global_step}" if part == 0 else f"{self.global_step}.{part}"
        batch.non_tensor_batch["uid"] = np.array([f"{prefix}-{i}" for i in range(len(batch))], dtype=object)
        return batch

    # ------------------------------------------------------------------ phases
    def rollout(self, batch: DataProto, timing: dict, metrics: dict) -> DataProto:
        """Generate n responses per prompt, then the actor's (and reference's, critic's) view of them.

        The weight sync inside generation is booked as its own phase (timing_s/weight_sync, out of
        timing_s/gen). The old_log_prob pass runs only when old_log_prob_source() says "actor".
        """
        return self.forward_passes(self.generate(batch, timing, metrics), timing, metrics)

    def generate(self, batch: DataProto, timing: dict, metrics: dict, part: int = 0) -> DataProto:
        """n responses per prompt (rollout.do_sample decides sampling or greedy), joined to the repeated prompts."""
        arr = self.config.actor_rollout_ref
        n = arr.rollout.n
        gen_batch = batch.pop(batch_keys=list(GEN_KEYS), non_tensor_batch_keys=list(GEN_NON_TENSOR_KEYS))
        gen_batch.meta_info.update(self._gen_meta(do_sample=arr.rollout.do_sample, part=part))
        with timer("gen", timing):
            gen = self.roles.actor_rollout.generate_sequences(gen_batch)
        gen_metrics = pop_metrics(gen)
        weight_sync = gen_metrics.pop("timing_s/weight_sync", 0.0)
        timing["weight_sync"] = timing.get("weight_sync", 0.0) + weight_sync
        timing["gen"] -= weight_sync
        metrics.update(gen_metrics)
        self.add_reward_baselines(batch, gen_batch, timing)
        return batch.repeat(n, interleave=True).union(gen)

    def forward_passes(self, batch: DataProto, timing: dict, metrics: dict) -> DataProto:
        """Balance the rows over the ranks; old log-probs, reference log-probs and values as the run needs."""
        arr = self.config.actor_rollout_ref
        if self.config.trainer.balance_batch:
            # Shared-prefix packing saves most when a prompt's samples stay on one rank.
            group = arr.rollout.n if arr.model.use_shared_prefix else 1
            balance_batch(batch, self.roles.actor_rollout_dp_size, metrics, group_size=group)
        batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
        source = self.old_log_prob_source()
        batch.meta_info["old_log_probs_source"] = source
        # Every pass is called before any result is read: with pipeline.placement=split the critic's
        # values are computed while the policy pool computes log-probs (results cross pools at the union).
        outs = []
        if source == "actor":
            with timer("old_log_prob", timing):
                outs.append(self.roles.actor_rollout.compute_log_prob(batch))
        elif self.config.algorithm.use_kl_in_reward or self.config.distill.enabled:  # both read old_log_probs
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        if self.config.use_reference:
            with timer("ref", timing):
                outs.append(self.roles.actor_rollout.compute_ref_log_prob(batch))
        if self.roles.teacher is not None:  # on-policy distillation (tinyzero.algorithms.distill)
            with timer("teacher", timing):
                outs.append(self.roles.teacher.compute_teacher_log_prob(batch))
        if self.roles.critic is not None:
            with timer("values", timing):
                outs.append(self.roles.critic.compute_values(batch))
        for out in outs:
            metrics.update(pop_metrics(out))
            batch = batch.union(out)
        return batch

    def add_reward_baselines(self, batch: DataProto, gen_batch: DataProto, timing: dict) -> None:
        """ReMax (an estimator registered with needs_baseline): one greedy response per prompt, scored by
        the rule reward fn as veRL does; its total lands in batch["reward_baselines"] (prompts,), which
        the repeat then gives to each of the prompt's n samples. Timed as timing_s/gen_max (veRL's name)."""
        if not get_adv_estimator_spec(self.config.algorithm.adv_estimator).needs_baseline:
            return
        with timer("gen_max", timing):
            greedy = gen_batch.select()  # same prompts and meta, greedy, one response each
            greedy.meta_info.update(do_sample=False, n=1)
            out = self.roles.actor_rollout.generate_sequences(greedy)
            out.meta_info.pop("metrics", None)
            scored = DataProto(batch=out.batch, non_tensor_batch=dict(batch.non_tensor_batch))
            batch.batch["reward_baselines"] = self.reward_fn(scored).token_level_scores.sum(-1)  # (prompts,)

    def old_log_prob_source(self) -> str:
        """Where the PPO old log-probs come from this step.

        "rollout" with rollout.use_rollout_log_probs (bypass mode: the sampler's log-probs);
        "update" when the update is strictly on-policy (actor.ppo_epochs 1 and one mini-batch per
        train batch, so one optimizer step, and no in-reward KL needing them earlier): the old
        policy is the current one, the ratio is exactly 1, and the update uses its own log-probs
        detached; "actor" otherwise (a separate compute_log_prob pass).
        """
        arr = self.config.actor_rollout_ref
        if arr.rollout.use_rollout_log_probs:
            return "rollout"
        one_step = arr.actor.ppo_epochs == 1 and arr.actor.ppo_mini_batch_size == self.config.data.train_batch_size
        # The in-reward KL and distillation read the student's log-probs before the update.
        if one_step and not self.config.algorithm.use_kl_in_reward and not self.config.distill.enabled:
            return "update"
        return "actor"

    def _gen_meta(self, do_sample: bool, validate: bool = False, part: int = 0) -> dict:
        rollout = self.config.actor_rollout_ref.rollout
        # No eos_token_id: the rollout worker stops on every end id of the generation config (a list for
        # many chat models); the tokenizer's single eos here would override that list.
        meta = {"pad_token_id": self.tokenizer.pad_token_id, "do_sample": do_sample, "validate": validate,
                "global_steps": self.global_step,
                # Sampling depends only on (seed, step), so a resumed run draws what the original drew.
                "seed": rollout.seed + 7919 * self.global_step + (104729 if validate else 0) + 15485863 * part}
        if validate:
            vk = rollout.val_kwargs
            meta.update(n=vk.n, temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k,
                        do_sample=vk.do_sample)
        return meta

    def score(self, batch: DataProto, timing: dict, metrics: dict) -> DataProto:
        """Model reward (if any) + rule rewards -> token_level_scores; KL in reward -> token_level_rewards."""
        if "token_level_scores" not in batch.batch:  # rollout_filtered scores before it filters
            batch = self.compute_scores(batch, timing, metrics)
        if self.config.algorithm.use_kl_in_reward:
            batch, kl_metrics = apply_kl_penalty(batch, self.kl_ctrl, self.config.algorithm.kl_penalty)
            metrics.update(kl_metrics)
        else:
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        return batch

    def compute_scores(self, batch: DataProto, timing: dict, metrics: dict) -> DataProto:
        """token_level_scores (rule + model rewards), and the scorer's per-sample score and acc (non-tensors)."""
        with timer("reward", timing):
            out = self.reward_fn(batch)
            scores = out.token_level_scores  # (rows, R): the rule score at the last response token
            if self.roles.reward_model is not None:
                # The learned reward adds to the rule reward (a custom_fn returning 0 gives the RM alone).
                rm = self.roles.reward_model.compute_rm_score(batch)
                metrics.update(pop_metrics(rm))
                batch = batch.union(rm)
                scores = scores + batch.batch["rm_scores"]
                metrics["reward/rm_score/mean"] = float(batch.batch["rm_scores"].sum(-1).mean())
                for sample, value in zip(out.samples, batch.batch["rm_scores"].sum(-1).tolist()):
                    sample["rm_score"] = value
            batch.batch["token_level_scores"] = scores
            for key in ("score", "acc"):
                batch.non_tensor_batch[key] = np.array([float(s[key]) for s in out.samples], dtype=np.float64)
            if self.config.trainer.rollout_data_dir:  # the step's dump reads them, following the rows
                batch.non_tensor_batch["reward_extra_info"] = extra_info_rows(getattr(out, "reward_extra_info", {}),
                                                                              len(batch))
            metrics.update(out.metrics)
            self._log_samples(out.samples, "train")
        return batch

    def rollout_filtered(self, timing: dict, metrics: dict) -> DataProto:
        """DAPO's dynamic sampling (algorithm.filter_groups): generate and score prompt batches, dropping the groups
        whose samples all have the same filter_groups.metric, until data.train_batch_size prompts are kept; the
        batch is cut to exactly train_batch_size x n rows (as veRL), then the forward passes run on it.

        Every batch drawn advances the data loader (its position is in the checkpoint). The generation batches'
        metrics are averaged; train/num_gen_batches counts them, train/kept_group_fraction is the fraction of
        their groups that passed the filter.
        """
        fg = self.config.algorithm.filter_groups
        want, n = self.config.data.train_batch_size, self.config.actor_rollout_ref.rollout.n
        kept, part_metrics, num_groups, num_kept = [], [], 0, 0
        while num_kept < want:
            if 0 < fg.max_num_gen_batches <= len(part_metrics):
                raise ValueError(f"step {self.global_step}: {num_kept} of data.train_batch_size={want} prompts kept "
                                 f"after algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} "
                                 f"generation batches: too few groups have samples of different {fg.metric}. "
                                 "Check that the data is not too hard (or too easy) for the model, or raise "
                                 "max_num_gen_batches (0: no limit)")
            part, part_metrics = len(part_metrics), [*part_metrics, {}]
            batch = self.generate(self.next_batch(part), timing, part_metrics[-1], part=part)
            batch = self.compute_scores(batch, timing, part_metrics[-1])
            result = filter_groups(batch.non_tensor_batch["uid"], FILTER_METRICS[fg.metric](batch))
            kept.append(batch.select_idxs(result.rows))
            num_groups, num_kept = num_groups + result.num_groups, num_kept + result.num_kept_groups
        metrics.update(merge_worker_metrics(part_metrics))
        metrics["train/num_gen_batches"] = float(len(part_metrics))
        metrics["train/kept_group_fraction"] = num_kept / num_groups
        return self.forward_passes(DataProto.concat(kept)[: want * n], timing, metrics)

    def compute_advantages(self, batch: DataProto, timing: dict, metrics: dict) -> DataProto:
        alg = self.config.algorithm
        with timer("adv", timing):
            batch = compute_advantage(batch, alg.adv_estimator, gamma=alg.gamma, lam=alg.lam,
                                      num_repeat=self.config.actor_rollout_ref.rollout.n,
                                      norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, config=alg)
            if self.config.distill.enabled:  # "advantage" mode adds the teacher's per-token signal here
                metrics.update(apply_distillation(batch, self.config.distill))
            return batch

    def update_models(self, batch: DataProto, timing: dict, metrics: dict) -> None:
        """The critic update, then the actor update (after critic_warmup steps). Both are called before
        either result is read, so with pipeline.placement=split the two pools update at the same time."""
        critic = self.update_critic(batch, timing)
        actor = self.update_actor(batch, timing)
        if critic is not None:
            out = merge_worker_metrics(critic)  # the critic pool's metrics reach the policy pool here
            self._check_finite(out, ("critic/vf_loss", "critic/grad_norm"), "critic/num_skipped_steps")
            metrics.update(out)
        if actor is not None:
            out = merge_worker_metrics(actor)
            self._check_finite(out, ("actor/pg_loss", "actor/grad_norm"), "actor/num_skipped_steps")
            metrics.update(out)

    def update_critic(self, batch: DataProto, timing: dict):
        """Start the critic update; its per-worker metrics (lazy on ranks outside the critic pool), or None."""
        if self.roles.critic is None:
            return None
        with timer("update_critic", timing):
            return self.roles.critic.update_critic(batch)

    def update_actor(self, batch: DataProto, timing: dict):
        """Start the actor update; its per-worker metrics, or None during critic warmup."""
        if self.global_step <= self.config.trainer.critic_warmup:
            return None
        batch.meta_info["temperature"] = self.config.actor_rollout_ref.rollout.temperature
        distill = self.config.distill
        if distill.enabled and distill.mode == "loss":  # the actor adds coef * KL(student || teacher)
            batch.meta_info["distill_loss"] = {"coef": distill.coef, "kl_type": distill.loss_kl_type}
        with timer("update_actor", timing):
            return self.roles.actor_rollout.update_actor(batch)

    # ------------------------------------------------------------------ validation, metrics, samples
    def dump_rollout(self, batch: DataProto, timing: dict) -> None:
        """trainer.rollout_data_dir: the step's responses to DIR/<step>.jsonl as veRL dumps them (rank 0; timed
        as timing_s/dump_rollout_generations)."""
        if self.config.trainer.rollout_data_dir:
            with timer("dump_rollout_generations", timing):
                dump_batch(self.tokenizer, batch, self.config.trainer.rollout_data_dir, self.global_step)

    def validate(self) -> dict[str, float]:
        metrics, samples = validate(self, self.val_dataset, self.val_reward_fn)
        self._log_samples(samples, "val", self.config.trainer.log_val_generations)
        return metrics

    def step_metrics(self, batch: DataProto, timing: dict) -> dict[str, float]:
        out = compute_data_metrics(batch, use_critic=self.roles.critic is not None,
                                   tis_cap=self.config.actor_rollout_ref.actor.tis_imp_ratio_cap)
        out.update(compute_timing_metrics(batch, timing))
        out.update(compute_throughput_metrics(batch, timing, self.world_size))
        out.update(compute_mfu_metrics(batch, timing, self.hf_config, self.roles.actor_rollout_dp_size,
                                       self.config.actor_rollout_ref.actor.ppo_epochs, self.device))
        out["perf/max_memory_allocated_gb"] = max_memory_allocated_gb(self.device)
        out["training/global_step"] = float(self.global_step)
        out["training/num_samples"] = float(len(batch))  # responses trained on this step
        out["training/epoch"] = float(self.train_loader.epoch)
        return out

    def _log_samples(self, samples: list[dict], split: str, limit: int | None = None) -> None:
        limit = self.config.trainer.log_samples if limit is None else limit
        if samples and limit > 0:
            self.tracker.log_samples(samples[:limit], step=self.global_step, split=split)

    # ------------------------------------------------------------------ checkpoints, export
    def save_roles(self, tmp: str) -> None:
        self.roles.actor_rollout.save_checkpoint(f"{tmp}/actor", self.global_step)
        if self.roles.critic is not None:
            self.roles.critic.save_checkpoint(f"{tmp}/critic", self.global_step)
        save_rng_state(tmp)

    def extra_state(self) -> dict:
        return {"kl_coef": float(self.kl_ctrl.value)}

    def load_roles(self, step_dir: str, state: dict) -> None:
        self.roles.actor_rollout.load_checkpoint(f"{step_dir}/actor")
        if self.roles.critic is not None:
            self.roles.critic.load_checkpoint(f"{step_dir}/critic")
        load_rng_state(step_dir, seed=self.config.trainer.seed)
        self.kl_ctrl.value = float(state["kl_coef"])

    def export_hf(self, out_dir: str) -> None:
        self.roles.actor_rollout.export_hf(out_dir)
