"""CriticWorker: the value model (LM backbone + scalar head) on FSDP2.

    wg = WorkerGroup(resource_pool=pool, cls_with_init=ClassWithInitArgs(CriticWorker, critic_config))
    wg.init_model()
    batch = batch.union(wg.compute_values(batch))   # values (rows, R)
    out = wg.update_critic(batch)                   # clipped value loss; out.meta_info["metrics"]

`critic.model.use_remove_padding` / `use_shared_prefix` select packed forward passes
(tinyzero.workers.packing) for values and updates.
"""

from __future__ import annotations

from tinyzero.distributed.parallel_dims import ParallelDims
from tinyzero.protocol import DataProto
from tinyzero.single_controller import Dispatch, Worker, register
from tinyzero.workers import checkpointing
from tinyzero.workers.common import offload_after_init, on_device, peak_memory_gb, prepare_role_model
from tinyzero.workers.config import CriticConfig, role_layout
from tinyzero.workers.critic import PPOCritic
from tinyzero.workers.optim import build_lr_scheduler, build_optimizer
from tinyzero.workers.packing import packing_mode


class CriticWorker(Worker):
    """Values and value-loss updates of the PPO critic."""

    def __init__(self, config: CriticConfig, dims: ParallelDims | None = None, rows_per_mini_batch: int | None = None):
        """`dims` and `rows_per_mini_batch` come from the run plan (tinyzero.plan); a worker built outside a
        run derives them from `config` on its pool."""
        super().__init__()
        self.config = config
        self.dims = role_layout(config, self.world_size) if dims is None else dims
        self._register_dispatch_collect_info("critic", self.dims.dp_rank(self.rank), self.dims.is_collect(self.rank))
        if rows_per_mini_batch is None:
            if config.ppo_mini_batch_size is None:
                raise ValueError("critic.ppo_mini_batch_size is None: set it (the trainer fills it from "
                                 "actor_rollout_ref.actor.ppo_mini_batch_size)")
            # Any micro-batch size works (exact scaling); a mini-batch must split over the data-parallel ranks.
            rows_per_mini_batch = self.dims.rows_per_rank(config.ppo_mini_batch_size, config.rollout_n)
        self.rows_per_mini_batch = rows_per_mini_batch
        self.critic: PPOCritic | None = None
        self.tokenizer = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        """Load the value model sharded over the pool, with AdamW and its lr schedule."""
        from tinyzero.models.loading import load_tokenizer

        cfg = self.config
        self.tokenizer = load_tokenizer(cfg.model.resolved_tokenizer_path, cfg.model.trust_remote_code)
        model = prepare_role_model(self, cfg.model, cfg.fsdp_config, self.dims, "value", packing=packing_mode(cfg.model))
        optimizer = build_optimizer(model.parameters(), cfg.optim)
        scheduler = build_lr_scheduler(optimizer, cfg.optim)
        dp_group = self.dims.dp_group(self.device_mesh, self.process_group)
        self.critic = PPOCritic(cfg, model, optimizer, scheduler, dp_group=dp_group, dp_size=self.dims.fsdp_size,
                                device=self.device, packing=packing_mode(cfg.model))
        offload_after_init(model, cfg.fsdp_config, optimizer)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="critic")
    def compute_values(self, data: DataProto) -> DataProto:
        """values (rows, R) at the response positions (0 where response_mask is 0)."""
        with on_device(self.critic.model, self.config.fsdp_config, self.device):
            values = self.critic.compute_values(data)
        return DataProto.from_dict(tensors={"values": values})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="critic")
    def update_critic(self, data: DataProto) -> DataProto:
        """Clipped value-loss update on this rank's rows; DataProto(meta_info={"metrics": {...}})."""
        with on_device(self.critic.model, self.config.fsdp_config, self.device, self.critic.optimizer):
            metrics = self.critic.update_critic(data, self.rows_per_mini_batch)
        metrics["perf/max_memory_allocated_gb/critic"] = peak_memory_gb(self.device)
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None):
        """Sharded critic checkpoint (model, optimizer, lr scheduler) in the role folder `local_path`.

        `max_ckpt_to_keep` is accepted for veRL compatibility; the checkpoint manager prunes.
        """
        with on_device(self.critic.model, self.config.fsdp_config, self.device, self.critic.optimizer):
            checkpointing.save_role(self, self.critic, local_path, global_step,
                                    self.config.checkpoint.contents)
        return local_path

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False):
        """Restore what `save_checkpoint` wrote."""
        with on_device(self.critic.model, self.config.fsdp_config, self.device, self.critic.optimizer):
            checkpointing.load_role(self, self.critic, local_path)
        return local_path
