"""ActorRolloutRefWorker: the policy's training, sampling and reference roles on one pool.

    wg = WorkerGroup(resource_pool=pool,
                     cls_with_init=ClassWithInitArgs(ActorRolloutRefWorker, config, "actor_rollout_ref"))
    wg.init_model()
    gen = wg.generate_sequences(prompts)            # rollout engine, weights synced from the actor
    old = wg.compute_log_prob(batch)                # old_log_probs, entropys
    ref = wg.compute_ref_log_prob(batch)            # ref_log_prob
    out = wg.update_actor(batch)                    # out.meta_info["metrics"]

Roles: "actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref". The actor is an
FSDP2-sharded causal LM with AdamW and an lr schedule; the reference is a separate frozen
FSDP2 copy; the rollout engine is built last, so its memory estimate sees what training
holds. Before each generation the actor's weights are streamed into the engine (only when
they changed since the last sync), in the order wake weights -> sync -> wake KV cache ->
generate -> sleep. The sync's wall time is reported as the metric timing_s/weight_sync (0 when
the weights had not changed); the trainer books it as its own phase.

`actor_rollout_ref.model.use_remove_padding` / `use_shared_prefix` select packed forward passes
(tinyzero.workers.packing) for the actor's and the reference's log-probs and the actor update.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from tinyzero.distributed.parallel_dims import ParallelDims
from tinyzero.protocol import DataProto
from tinyzero.single_controller import Dispatch, Worker, register
from tinyzero.workers import checkpointing
from tinyzero.workers.actor import PPOActor
from tinyzero.workers.common import (
    base_only,
    masked_mean_over_group,
    offload_after_init,
    on_device,
    peak_memory_gb,
    prepare_role_model,
    response_mask_of,
)
from tinyzero.workers.config import ActorRolloutRefConfig, policy_layouts
from tinyzero.workers.optim import build_lr_scheduler, build_optimizer
from tinyzero.workers.packing import packing_mode

logger = logging.getLogger(__name__)

ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref", "actor_ref")


class ActorRolloutRefWorker(Worker):
    """Actor (PPO update), rollout (generation) and reference (frozen log-probs) of the policy."""

    def __init__(self, config: ActorRolloutRefConfig, role: str, dims: dict[str, ParallelDims] | None = None,
                 rows_per_mini_batch: int | None = None):
        """`dims` (the layouts of the roles this worker holds) and `rows_per_mini_batch` come from the run
        plan (tinyzero.plan); a worker built outside a run derives them from `config` on its pool."""
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"role={role!r} is unknown; use one of {list(ROLES)}")
        self.config = config
        self.role = role
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref", "actor_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_rollout_ref", "actor_ref")
        # One layout per role; each registers the data-parallel rank its methods dispatch by. Ranks of
        # one rollout tensor-parallel group generate from the same prompts; the first one reports.
        mine = policy_layouts(config, self.world_size, role) if dims is None else dims
        self.dims = {name: mine[name] for name in ("actor", "ref", "rollout")
                     if name in mine and getattr(self, f"_is_{name}")}
        for name, dims in self.dims.items():
            self._register_dispatch_collect_info(name, dims.dp_rank(self.rank), dims.is_collect(self.rank))
        if rows_per_mini_batch is None:
            rows_per_mini_batch = self._rows_per_mini_batch() if self._is_actor else 0
        self.rows_per_mini_batch = rows_per_mini_batch
        self.actor: PPOActor | None = None
        self.ref: PPOActor | None = None
        self.rollout = None
        self.tokenizer = None
        self.stop_token_ids: list[int] = []
        self._weights_version = 0  # bumped whenever the actor's weights change
        self._synced_version = -1  # version last pushed into the rollout engine

    def _rows_per_mini_batch(self) -> int:
        """veRL's normalisation: prompts x rollout.n responses, shared by the data-parallel ranks."""
        # A micro-batch size that does not divide it is fine: the last micro-batch is shorter and
        # the loss scaling is exact for any split.
        n = int(getattr(self.config.rollout, "n", 1))
        return self.dims["actor"].rows_per_rank(self.config.actor.ppo_mini_batch_size, n)

    # ------------------------------------------------------------------ init
    def _build_fsdp_model(self, fsdp_config, dims, trainable: bool):
        model_config = self.config.model
        if not trainable and model_config.enable_gradient_checkpointing:
            model_config = dataclasses.replace(model_config, enable_gradient_checkpointing=False)
        if not trainable and model_config.lora_rank:  # a reference on its own pool: the base model
            model_config = dataclasses.replace(model_config, lora_rank=0)
        return prepare_role_model(self, model_config, fsdp_config, dims, "causal_lm", trainable=trainable,
                                  packing=packing_mode(model_config))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        """Build the actor (+ optimizer, lr schedule), the reference and the rollout engine, in that order."""
        from tinyzero.models.loading import load_tokenizer

        cfg = self.config
        if self._is_rollout:
            self._check_rollout_pool()
        self.tokenizer = load_tokenizer(cfg.model.resolved_tokenizer_path, cfg.model.trust_remote_code)
        if self._is_actor:
            fsdp = cfg.actor.fsdp_config
            model = self._build_fsdp_model(fsdp, self.dims["actor"], trainable=True)
            optimizer = build_optimizer(model.parameters(), cfg.actor.optim)
            scheduler = build_lr_scheduler(optimizer, cfg.actor.optim)
            self.actor = PPOActor(cfg.actor, model, optimizer, scheduler, dp_group=self._dp_group("actor"),
                                  dp_size=self.dims["actor"].fsdp_size, device=self.device,
                                  packing=packing_mode(cfg.model))
            offload_after_init(model, fsdp, optimizer)
        if self._is_ref and self.actor is not None and cfg.model.lora_rank:
            # LoRA: the reference is the actor's model with its adapters disabled (no second copy).
            self.ref = PPOActor(cfg.actor, self.actor.model, dp_group=self._dp_group("actor"),
                                dp_size=self.dims["actor"].fsdp_size, device=self.device, packing=self.actor.packing)
        elif self._is_ref:
            fsdp = cfg.ref.fsdp_config
            model = self._build_fsdp_model(fsdp, self.dims["ref"], trainable=False)
            self.ref = PPOActor(cfg.actor, model, dp_group=self._dp_group("ref"), dp_size=self.dims["ref"].fsdp_size,
                                device=self.device, packing=packing_mode(cfg.model))
            offload_after_init(model, fsdp)
        if self._is_rollout:
            self.rollout = self._build_rollout()
            self.stop_token_ids = self._stop_token_ids()
        self._weights_version += 1

    def _dp_group(self, role: str):
        return self.dims[role].dp_group(self.device_mesh, self.process_group)

    def _check_rollout_pool(self) -> None:
        """vLLM (external_launcher) builds its parallel groups over the whole torchrun world, so its
        engine must live on every rank: a policy pool that is a subset of the world would hang there."""
        import torch.distributed as dist

        if self.config.rollout.name != "vllm" or not dist.is_initialized():
            return
        world = dist.get_world_size()
        if self.world_size != world:
            raise ValueError(f"rollout.name='vllm' runs one engine per rank of the whole torchrun world "
                             f"({world} ranks), but the rollout pool has {self.world_size}; set "
                             f"pipeline.placement=colocate (or rollout.name=native for a split placement)")

    def _stop_token_ids(self) -> list[int]:
        """End-of-sequence ids: the generation config's (it may list several) and the tokenizer's."""
        from transformers import GenerationConfig

        ids = [] if self.tokenizer.eos_token_id is None else [int(self.tokenizer.eos_token_id)]
        try:
            gen = GenerationConfig.from_pretrained(self.config.model.path, local_files_only=True)
        except OSError:  # no generation_config.json in the folder
            return ids
        eos = gen.eos_token_id
        ids += [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        return sorted(set(ids))

    def _build_rollout(self):
        from tinyzero.agent import build_agent_engine
        from tinyzero.models.loading import load_hf_config

        cfg = self.config
        hf_config = load_hf_config(cfg.model.path, cfg.model.trust_remote_code, cfg.model.override_config)
        dims = self.dims["rollout"]
        if self.actor is None and cfg.rollout.free_cache_engine and cfg.rollout.sleep_level == 2:
            raise ValueError("actor_rollout_ref.rollout.sleep_level=2 discards the engine's weights after each "
                             "generation, and this rollout pool holds no actor to re-send them from; "
                             "set actor_rollout_ref.rollout.sleep_level=1")
        # The native engine splits its decode over the ranks of a tensor-parallel group (vLLM makes its own).
        tp_group = dims.tp_mesh(dims.build_mesh(self.device_mesh)).get_group() \
            if dims.tp > 1 and cfg.rollout.name in ("native", "auto") else None
        # Without an actor in this process the engine starts from the checkpoint's weights.
        # With rollout.multi_turn.enable the engine runs inside the agent loop.
        return build_agent_engine(cfg.rollout, cfg.model.path, self.tokenizer, hf_config=hf_config,
                                  device=self.device, dp_rank=dims.dp_rank(self.rank), load_weights=self.actor is None,
                                  trust_remote_code=cfg.model.trust_remote_code, lora_rank=cfg.model.lora_rank,
                                  tp_group=tp_group)

    # ------------------------------------------------------------------ rollout
    def _sync_weights(self) -> None:
        """Stream the actor's full parameters into the engine, one bucket at a time (with LoRA: the base
        once, then the adapters only; see tinyzero.models.lora.sync_adapters)."""
        from tinyzero.distributed.full_params import iter_full_params
        from tinyzero.rollout.config import sync_bucket_bytes

        if self.actor is None or self._synced_version == self._weights_version:
            return
        bucket = sync_bucket_bytes(self.config.rollout, self.device)
        fsdp = self.config.actor.fsdp_config
        with on_device(self.actor.model, fsdp, self.device):
            if self.config.model.lora_rank:
                from tinyzero.models.lora import sync_adapters

                sync_adapters(self.actor.model, self.rollout, bucket, with_base=self._synced_version < 0)
            else:
                self.rollout.update_weights(iter_full_params(self.actor.model, bucket))
        self._synced_version = self._weights_version

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="rollout")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses for this rollout group's prompts with the current actor weights."""
        if self.rollout is None:
            raise ValueError(f"generate_sequences needs a rollout role; this worker is {self.role!r}")
        meta = {"eos_token_id": self.stop_token_ids, "pad_token_id": self.tokenizer.pad_token_id}
        prompts.meta_info = {**meta, **prompts.meta_info}
        self.rollout.wake_up(tags=["weights"])
        start = time.perf_counter()
        self._sync_weights()
        sync_s = time.perf_counter() - start
        self.rollout.wake_up(tags=["kv_cache"])
        try:
            out = self.rollout.generate_sequences(prompts)
        finally:
            self.rollout.sleep()
            if getattr(self.config.rollout, "sleep_level", 1) == 2:
                self._synced_version = -1  # level-2 sleep discards the engine's weights
        metrics = out.meta_info.setdefault("metrics", {})
        metrics["timing_s/weight_sync"] = sync_s
        metrics["perf/max_memory_allocated_gb/rollout"] = peak_memory_gb(self.device)
        # Device memory after each engine phase (vLLM: init, sync, wake, sleep); empty when not tracked.
        memory_metrics = getattr(self.rollout, "memory_metrics", None)
        if memory_metrics is not None:
            metrics.update(memory_metrics())
        return out

    # ------------------------------------------------------------------ weights across pools
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights(self, bridge_ranks: list[int]) -> float:
        """Trainer pool (tinyzero.trainer.async_pipeline): gather the actor's full parameters bucket by
        bucket; the pool's first rank broadcasts them over the bridge group to the rollout pool.
        Returns the float64 checksum of what was sent (0.0 on the other ranks)."""
        from tinyzero.distributed.full_params import iter_full_params
        from tinyzero.rollout.config import sync_bucket_bytes
        from tinyzero.rollout.device import resolve_dtype
        from tinyzero.rollout.weight_bridge import bridge_group, send_params

        if self.actor is None:
            raise ValueError(f"send_weights needs the actor role; this worker is {self.role!r}")
        bucket = sync_bucket_bytes(self.config.rollout, self.device)
        with on_device(self.actor.model, self.config.actor.fsdp_config, self.device):
            return send_params(iter_full_params(self.actor.model, bucket), bridge_group(bridge_ranks),
                               src=bridge_ranks[0], send=self.rank == 0, bucket_bytes=bucket,
                               dtype=resolve_dtype(self.config.rollout.dtype, self.device))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights(self, bridge_ranks: list[int]) -> float:
        """Rollout pool: load the weights send_weights broadcasts into the engine. Returns the float64
        checksum of the engine's copy of them (of the received tensors if the engine has no torch model)."""
        from tinyzero.rollout.weight_bridge import bridge_group, checksum, receive_params, tensor_sum

        if self.rollout is None:
            raise ValueError(f"receive_weights needs the rollout role; this worker is {self.role!r}")
        names, received = [], [0.0]  # names and a running checksum: no received tensor outlives its bucket

        def stream():
            for name, tensor in receive_params(bridge_group(bridge_ranks), bridge_ranks[0], self.device):
                names.append(name)
                received[0] += tensor_sum(tensor)
                yield name, tensor

        self.rollout.wake_up(tags=["weights"])
        try:
            self.rollout.update_weights(stream())
            model = getattr(self.rollout, "model", None)
            held = model.state_dict() if hasattr(model, "state_dict") else {}
            if names and all(name in held for name in names):
                return checksum((name, held[name]) for name in names)
            return received[0]
        finally:
            self.rollout.sleep()

    # ------------------------------------------------------------------ log-probs
    def _log_prob_settings(self, data: DataProto):
        """(temperature, micro-batch size, dynamic batching, token budget) of the actor's log-prob pass."""
        rollout = self.config.rollout
        temperature = float(data.meta_info.get("temperature", getattr(rollout, "temperature", 1.0)))
        return temperature, rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_use_dynamic_bsz, \
            rollout.log_prob_max_token_len_per_gpu

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="actor")
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """old_log_probs and entropys (rows, R) of the responses under the current actor."""
        if self.actor is None:
            raise ValueError(f"compute_log_prob needs the actor role; this worker is {self.role!r}")
        temperature, mbs, dynamic, max_tokens = self._log_prob_settings(data)
        with on_device(self.actor.model, self.config.actor.fsdp_config, self.device):
            log_probs, entropys = self.actor.compute_log_prob(data, mbs, dynamic, max_tokens, temperature, True)
        entropy = masked_mean_over_group(entropys, response_mask_of(data), self.process_group)
        return DataProto.from_dict(tensors={"old_log_probs": log_probs, "entropys": entropys},
                                   meta_info={"temperature": temperature, "metrics": {"actor/entropy": entropy}})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="ref")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """ref_log_prob (rows, R) of the responses under the frozen reference policy."""
        if self.ref is None:
            raise ValueError(f"compute_ref_log_prob needs the ref role; this worker is {self.role!r}")
        ref = self.config.ref
        temperature = float(data.meta_info.get("temperature", getattr(self.config.rollout, "temperature", 1.0)))
        shared = self.ref.model is getattr(self.actor, "model", None)  # LoRA: the base under the adapters
        fsdp = self.config.actor.fsdp_config if shared else ref.fsdp_config
        with on_device(self.ref.model, fsdp, self.device), base_only(self.ref.model, shared):
            log_probs, _ = self.ref.compute_log_prob(data, ref.log_prob_micro_batch_size_per_gpu,
                                                     ref.log_prob_use_dynamic_bsz,
                                                     ref.log_prob_max_token_len_per_gpu, temperature, False)
        return DataProto.from_dict(tensors={"ref_log_prob": log_probs}, meta_info={"temperature": temperature})

    # ------------------------------------------------------------------ update
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="actor")
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO update on this rank's rows; returns DataProto(meta_info={"metrics": {...}})."""
        if self.actor is None:
            raise ValueError(f"update_actor needs the actor role; this worker is {self.role!r}")
        data.meta_info.setdefault("temperature", getattr(self.config.rollout, "temperature", 1.0))
        fsdp = self.config.actor.fsdp_config
        with on_device(self.actor.model, fsdp, self.device, self.actor.optimizer):
            metrics = self.actor.update_policy(data, self.rows_per_mini_batch)
        self._weights_version += 1
        metrics["perf/max_memory_allocated_gb/actor"] = peak_memory_gb(self.device)
        return DataProto(meta_info={"metrics": metrics})

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None):
        """Sharded actor checkpoint (model, optimizer, lr scheduler) in the role folder `local_path`.

        `max_ckpt_to_keep` is accepted for veRL compatibility; the checkpoint manager prunes.
        """
        if self.actor is None:
            return None
        with on_device(self.actor.model, self.config.actor.fsdp_config, self.device, self.actor.optimizer):
            checkpointing.save_role(self, self.actor, local_path, global_step,
                                    self.config.actor.checkpoint.contents)
        return local_path

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False):
        """Restore what `save_checkpoint` wrote (works with a different number of ranks)."""
        if self.actor is None:
            return None
        with on_device(self.actor.model, self.config.actor.fsdp_config, self.device, self.actor.optimizer):
            checkpointing.load_role(self, self.actor, local_path)
        self._weights_version += 1
        return local_path

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> str:
        """Write the actor as an HF folder (safetensors + config + tokenizer)."""
        if self.actor is None:
            raise ValueError(f"export_hf needs the actor role; this worker is {self.role!r}")
        with on_device(self.actor.model, self.config.actor.fsdp_config, self.device):
            checkpointing.export_hf(self, self.actor.model, out_dir, self.tokenizer)
        return out_dir
