"""Asynchronous RL in one torchrun world: a rollout pool generates while the trainer pool trains.

`pipeline.max_staleness=K` (K >= 1; or `pipeline.rollout_pool_size > 0` with K=0 for the same pools
on-policy) puts a rollout-only ActorRolloutRefWorker (native engine) on the last
`rollout_pool_size` ranks and the actor, reference and critic on the others. Every rank runs
the same driver (SPMD). Worker calls compute on their pool at call time and hand their result
to the other ranks when it is first used (single_controller/future.py), so

    gen_next = rollout_wg.generate_sequences(batch_{k+1})   # rollout ranks compute
    actor_wg.update_actor(batch_k)                          # trainer ranks compute (issued first)

runs the two at once. One step k:

    1. take the oldest in-flight generation (batch k) and score it (every rank)
    2. old log-probs / reference / values, advantages (trainer pool)
    3. issue the critic and actor updates, then top the queue up to K in-flight generations
       (the rollout pool generates them now, with the weights it holds: version k-1 at K=1)
    4. wait for the in-flight generations, then broadcast the new weights (version k) from the
       trainer pool's first rank to the rollout pool (rollout/weight_bridge.py, bucketed)

So batch j is generated with version max(0, j-K-1) and trained at version j-1: staleness K after
the K warm-up steps, never more (checked every step). Only the updates overlap generation: step
2's results feed the driver on every rank, and a result crossing pools is a rendezvous.

Every sample carries its weight version (non-tensor "weight_version"). Metrics: async/staleness/
{mean,max,frac_<s>}, async/queue_depth, async/rollout_idle_frac (1 - the rollout ranks' time
generating and loading weights / step time), async/trainer_idle_frac (the trainer ranks' wait for
generations / step time), async/weight_version, async/weight_checksum/{trainer,rollout} (float64
sums of the weights sent and of the engine's copy).

Partial rollouts (pipeline.partial_rollout): the generation issued in step 3 decodes in segments
(rollout/partial.py), and the trainer pool sends version k right after its update (push_weights,
before any result crosses pools) instead of in step 4. The rollout ranks take it at their next
segment boundary and continue the unfinished rows under it (or take it when their generation ends).
Every token records its version (batch key rollout_token_versions); a sample's weight_version and
staleness are its oldest token's; async/partial_rollout/mixed_frac counts samples with two versions.

Checkpoints: the queue is drained at every planned save (no generation is issued past the next
save step), so a resumed run continues exactly as the uninterrupted one. A save at an unplanned
step (a signal) rewinds the data cursor to the oldest in-flight batch instead; the resumed run
regenerates it with the saved weights.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tinyzero.algorithms.rollout_correction import seq_mis_keep
from tinyzero.protocol import DataProto
from tinyzero.rollout.weight_bridge import BridgeSource, announce, open_bridge
from tinyzero.single_controller import (
    ClassWithInitArgs,
    ResourcePool,
    WorkerGroup,
    create_colocated_worker_cls,
)
from tinyzero.single_controller.future import flush_pending, materialize
from tinyzero.trainer.checkpoint import save_trainer_state
from tinyzero.trainer.loop import pop_metrics
from tinyzero.trainer.metrics import timer
from tinyzero.trainer.ppo import GEN_KEYS, GEN_NON_TENSOR_KEYS, PPOTrainer


@dataclass
class Flight:
    """One generation in flight: the prompt batch it was issued for and what it was issued with."""

    index: int          # the step that trains on it
    prompts: DataProto  # the prompt batch without the generation keys
    gen: object         # the (lazy) generate_sequences result
    version: int        # actor updates in the rollout engine's weights
    cursor: dict        # the data loader's state before this batch was drawn


def build_async_roles(plan):
    """(Roles on the trainer pool, the rollout WorkerGroup, the bridge ranks); opens the bridge group."""
    from tinyzero.trainer.builder import Roles, role_classes
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker

    cfg = plan.config
    trainer_ranks, rollout_ranks = list(plan.pools["actor"]), list(plan.pools["rollout"])
    classes = role_classes(plan, "actor_ref" if cfg.use_reference else "actor")
    trainer_pool = ResourcePool(ranks=trainer_ranks, name="trainer")
    rollout_pool = ResourcePool(ranks=rollout_ranks, name="rollout")
    wgs = WorkerGroup(resource_pool=trainer_pool, cls_with_init=create_colocated_worker_cls(classes)).spawn(
        prefix_set=set(classes))
    rollout = WorkerGroup(resource_pool=rollout_pool,
                          cls_with_init=ClassWithInitArgs(ActorRolloutRefWorker, cfg.actor_rollout_ref, "rollout",
                                                          dims={"rollout": plan.dims["rollout"]}))
    bridge = [trainer_ranks[0], *rollout_ranks]
    open_bridge(bridge)
    for name in ("critic", "reward_model", "actor_rollout"):
        if name in wgs:
            wgs[name].init_model()
    rollout.init_model()
    if cfg.pipeline.partial_rollout and rollout.is_local:
        from tinyzero.rollout.partial import PartialRollout

        worker = rollout.worker
        worker.rollout = PartialRollout(worker.rollout, cfg.pipeline.partial_rollout_chunk,
                                        BridgeSource(bridge, worker.device))
    flush_pending()  # deliver the init results now: nothing may be left crossing pools before the first sync
    roles = Roles(actor_rollout=wgs["actor_rollout"], critic=wgs.get("critic"), reward_model=wgs.get("reward_model"),
                  actor_rollout_dp_size=plan.dims["actor"].dp_size, rollout_dp_size=plan.dims["rollout"].dp_size)
    return roles, rollout, bridge


def sample_versions(token_versions: torch.Tensor, default: int) -> tuple[np.ndarray, float]:
    """(Each row's oldest token version (`default` for a row without tokens), the fraction of rows whose
    tokens carry more than one version). token_versions: (rows, R) int, -1 on padding."""
    valid = token_versions >= 0                                                         # (rows, R)
    oldest = torch.where(valid, token_versions, torch.iinfo(torch.int64).max).min(dim=1).values  # (rows,)
    newest = token_versions.max(dim=1).values                                           # (rows,)
    has = valid.any(dim=1)
    versions = torch.where(has, oldest, default).numpy().astype(np.int64)
    return versions, float((has & (newest != oldest)).float().mean())


class AsyncPPOTrainer(PPOTrainer):
    """PPOTrainer whose generations come from a rollout pool, up to pipeline.max_staleness updates ahead."""

    def __init__(self, *args, rollout, bridge_ranks: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.rollout_wg = rollout
        self.bridge_ranks = bridge_ranks
        self.max_staleness = self.config.pipeline.max_staleness
        self.partial = self.config.pipeline.partial_rollout
        self.queue: deque[Flight] = deque()
        self.next_index = 1         # the step the next drawn batch is for
        self.policy_version = 0     # actor updates applied
        self.rollout_version = None  # actor updates in the engine's weights (None: not synced yet)
        self.checksums = {"trainer": 0.0, "rollout": 0.0}
        self._clock = dict.fromkeys(("gen", "wait_gen", "receive"), 0.0)  # this step's seconds per pipeline phase
        self._staleness = np.zeros(1, dtype=np.int64)  # per row of this step's batch
        self._mixed_frac = 0.0  # rows whose tokens carry two weight versions (partial rollouts)

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, float]:
        metrics, timing = {}, {}
        self._clock = dict.fromkeys(self._clock, 0.0)
        with timer("step", timing):
            self.ensure_synced()
            if not self.queue:
                self.submit(timing)
            batch = self.receive(self.queue.popleft(), timing, metrics)
            batch = self.compute_scores(batch, timing, metrics)
            batch = self.forward_passes(batch, timing, metrics)
            batch = self.score(batch, timing, metrics)
            batch = self.compute_advantages(batch, timing, metrics)
            self.update_models(batch, timing, metrics)  # update_actor tops the queue up
            self.dump_rollout(batch, timing)
            if self.global_step > self.config.trainer.critic_warmup:
                self.policy_version += 1
            self.sync_weights(timing)
        clocks = self.gather_clocks(timing["step"])
        timing["gen"] = clocks["rollout"]["gen"]  # the rollout pool's generation time (not the trainer's wait)
        metrics.update(self.step_metrics(batch, timing))
        metrics.update(self.pipeline_metrics(clocks))
        return metrics

    def old_log_prob_source(self) -> str:
        """"actor" when pipeline.rollout_rs_threshold is set: the sequence ratio needs the trainer's old
        log-probs before the update; otherwise as in the synchronous loop."""
        return "actor" if self.config.pipeline.rollout_rs_threshold > 0 else super().old_log_prob_source()

    def forward_passes(self, batch: DataProto, timing: dict, metrics: dict) -> DataProto:
        """The trainer pool's passes; then, with pipeline.rollout_rs_threshold, sequence-level masked
        importance sampling: responses whose sequence ratio is out of bounds leave the update."""
        batch = super().forward_passes(batch, timing, metrics)
        threshold = self.config.pipeline.rollout_rs_threshold
        if threshold > 0:
            mask = batch.batch["response_mask"]  # (rows, R)
            keep = seq_mis_keep(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], mask, threshold)
            batch.batch["response_mask"] = mask * keep.unsqueeze(-1).to(mask.dtype)
            dropped = (~keep).to(mask.dtype).unsqueeze(-1).expand_as(mask)  # (rows, R)
            metrics["rollout_corr/rollout_rs_masked_fraction"] = float((dropped * mask).sum() / mask.sum().clamp(min=1))
            metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = float((~keep).float().mean())
        return batch

    def update_actor(self, batch: DataProto, timing: dict):
        """Issue the actor update (the trainer pool computes it now), then the next generations (the
        rollout pool computes them now): the two overlap until either result is read."""
        out = super().update_actor(batch, timing)
        incoming = self.policy_version + 1 if self.partial and out is not None else None
        if self.fill_queue(timing, incoming) and incoming is not None:
            self.push_weights(incoming, timing)
        return out

    # ------------------------------------------------------------------ the queue
    def _boundary(self) -> int:
        """The last step a generation may be issued for: the next planned save (the queue drains there)."""
        freq, step = self.config.trainer.save_freq, max(self.global_step, 1)
        last = self.total_steps
        return min(last, -(-step // freq) * freq) if freq > 0 else last

    def fill_queue(self, timing: dict, incoming: int | None = None) -> int:
        """Top the queue up to max_staleness generations; returns how many were issued."""
        issued = 0
        while len(self.queue) < self.max_staleness and self.next_index <= self._boundary():
            self.submit(timing, incoming)
            issued += 1
        return issued

    def submit(self, timing: dict, incoming: int | None = None) -> None:
        """Draw the prompts of step next_index and issue their generation on the rollout pool. With
        partial rollouts, `incoming` is the weight version the trainer pool sends while it runs."""
        index, step = self.next_index, self.global_step
        cursor = copy.deepcopy(self.train_loader.state_dict())
        self.global_step = index  # the batch's uids and sampling seed are its step's, as in the synchronous loop
        try:
            prompts = self.next_batch()
            gen_batch = prompts.pop(batch_keys=list(GEN_KEYS), non_tensor_batch_keys=list(GEN_NON_TENSOR_KEYS))
            gen_batch.meta_info.update(self._gen_meta(do_sample=self.config.actor_rollout_ref.rollout.do_sample))
            if self.partial:
                gen_batch.meta_info["rollout_weight_version"] = self.rollout_version
                if incoming is not None:
                    gen_batch.meta_info["partial_rollout_version"] = incoming
        finally:
            self.global_step = step
        start = time.perf_counter()
        gen = self.rollout_wg.generate_sequences(gen_batch)  # computed now on the rollout ranks only
        self._clock["gen"] += time.perf_counter() - start
        self.queue.append(Flight(index, prompts, gen, self.rollout_version, cursor))
        self.next_index += 1

    def receive(self, flight: Flight, timing: dict, metrics: dict) -> DataProto:
        """The flight's responses joined to its repeated prompts, each row tagged with its weight version."""
        if flight.index != self.global_step:
            raise RuntimeError(f"async pipeline: step {self.global_step} got the batch drawn for step {flight.index}")
        staleness = self.policy_version - flight.version
        if not 0 <= staleness <= self.max_staleness:
            raise RuntimeError(f"async pipeline: step {self.global_step} would train on weights {staleness} updates "
                               f"old (pipeline.max_staleness={self.max_staleness})")
        start = time.perf_counter()
        gen = materialize(flight.gen)
        self._clock["wait_gen"] += time.perf_counter() - start
        gen_metrics = pop_metrics(gen)
        gen_metrics.pop("timing_s/weight_sync", None)  # the rollout pool holds no actor: weights come by broadcast
        metrics.update(gen_metrics)
        batch = flight.prompts.repeat(self.config.actor_rollout_ref.rollout.n, interleave=True).union(gen)
        versions = np.full(len(batch), flight.version, dtype=np.int64)
        if "rollout_token_versions" in batch.batch:  # partial rollouts: a sample is as old as its oldest token
            versions, self._mixed_frac = sample_versions(batch.batch["rollout_token_versions"], flight.version)
        batch.non_tensor_batch["weight_version"] = versions
        self._staleness = self.policy_version - versions
        return batch

    # ------------------------------------------------------------------ weights
    def push_weights(self, version: int, timing: dict) -> None:
        """Partial rollouts: right after the actor update, while the generation just issued runs, send
        weights `version` to the rollout pool. The rollout ranks take them at their next segment boundary
        (rollout/partial.py), or here once their generation is done. Direct worker calls, not group
        calls: a group call would first deliver the update's result, which waits for the rollout pool."""
        actor, rollout = self.roles.actor_rollout, self.rollout_wg
        with timer("weight_sync", timing):
            if actor.is_local:
                if dist.get_rank() == self.bridge_ranks[0]:
                    announce(self.bridge_ranks, version)
                self.checksums["trainer"] = float(actor.worker.send_weights(self.bridge_ranks))
            if rollout.is_local:
                start = time.perf_counter()
                self.checksums["rollout"] = float(rollout.worker.rollout.take_weights(version))
                self._clock["receive"] += time.perf_counter() - start
        self.rollout_version = version

    def ensure_synced(self) -> None:
        if self.rollout_version is None:
            self.sync_weights({})

    def sync_weights(self, timing: dict) -> None:
        """Wait for the in-flight generations (the engine must be idle), then broadcast the actor's
        weights to the rollout pool if they changed. Both pools' calls are issued before either is read."""
        start = time.perf_counter()
        flush_pending()  # every result still crossing pools (the in-flight generations), in call order
        self._clock["wait_gen"] += time.perf_counter() - start
        if self.rollout_version == self.policy_version:
            return
        with timer("weight_sync", timing):
            sent = self.roles.actor_rollout.send_weights(self.bridge_ranks)
            start = time.perf_counter()
            got = self.rollout_wg.receive_weights(self.bridge_ranks)
            self._clock["receive"] += time.perf_counter() - start
            self.checksums = {"trainer": float(materialize(sent)[0]), "rollout": float(materialize(got)[0])}
        self.rollout_version = self.policy_version

    # ------------------------------------------------------------------ metrics
    def gather_clocks(self, step_s: float) -> dict[str, dict]:
        """This step's pipeline clocks of the trainer pool's and the rollout pool's first ranks."""
        clocks: list = [None] * dist.get_world_size()
        dist.all_gather_object(clocks, {**self._clock, "step": step_s, "checksums": dict(self.checksums)})
        return {"trainer": clocks[0], "rollout": clocks[self.bridge_ranks[1]]}

    def pipeline_metrics(self, clocks: dict[str, dict]) -> dict[str, float]:
        """Staleness (of the step's samples), queue depth, idle fractions, weight version and checksums."""
        trainer, rollout = clocks["trainer"], clocks["rollout"]
        staleness = self._staleness  # per row: updates since its oldest token's weights
        out = {"async/staleness/mean": float(staleness.mean()), "async/staleness/max": float(staleness.max()),
               "async/queue_depth": float(len(self.queue)), "async/weight_version": float(self.rollout_version),
               "async/weight_checksum/trainer": trainer["checksums"]["trainer"],
               "async/weight_checksum/rollout": rollout["checksums"]["rollout"]}
        if self.partial:
            out["async/partial_rollout/mixed_frac"] = self._mixed_frac
        for s in range(self.max_staleness + 1):
            out[f"async/staleness/frac_{s}"] = float((staleness == s).mean())
        out["async/trainer_idle_frac"] = trainer["wait_gen"] / max(trainer["step"], 1e-9)
        out["async/rollout_idle_frac"] = 1.0 - (rollout["gen"] + rollout["receive"]) / max(rollout["step"], 1e-9)
        return out

    # ------------------------------------------------------------------ validation, checkpoints
    def validate(self) -> dict[str, float]:
        """Validation generates on the rollout pool, with the trainer's current weights."""
        import dataclasses

        self.sync_weights({})
        roles, self.roles = self.roles, dataclasses.replace(self.roles, actor_rollout=self.rollout_wg)
        try:
            return super().validate()
        finally:
            self.roles = roles

    def save_checkpoint(self) -> None:
        """As Driver.save_checkpoint; with generations in flight (an unplanned save) the data cursor is
        rewound to the oldest of them, so a resumed run draws and generates them again."""
        cursor = self.queue[0].cursor if self.queue else self.train_loader.state_dict()
        with self.ckpt.saving(self.global_step) as tmp:
            self.save_roles(tmp)
            save_trainer_state(tmp, {"global_step": self.global_step, "dataloader": cursor, **self.extra_state()})

    def extra_state(self) -> dict:
        return {**super().extra_state(), "policy_version": self.policy_version}

    def load_roles(self, step_dir: str, state: dict) -> None:
        super().load_roles(step_dir, state)
        self.policy_version = int(state.get("policy_version", state["global_step"]))
        self.next_index = int(state["global_step"]) + 1
        self.rollout_version = None  # the engine still holds the initial weights
