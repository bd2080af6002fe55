"""Pieces every FSDP2 worker shares: its mesh, device residency around phases, tensor metrics.

`prepare_role_model` is the one ordered preparation of every role's model: built, parallelized and
sharded over the worker's pool with the layout of its ParallelDims (1-D over all pool ranks, or 2-D
(dp_replicate, dp_shard) for hybrid sharding), then made ready for the role's passes.
`on_device` brings offloaded parameters (and optionally optimizer state) to the device for one
phase and offloads them again after, when the FSDP config asks for offloading between phases.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tinyzero.distributed.parallel_dims import ParallelDims
from tinyzero.models.config import FSDPConfig
from tinyzero.workers.packing import PACKINGS, Packing
from tinyzero.workers.scaling import all_reduce_sum


def prepare_role_model(worker, model_config, fsdp_config: FSDPConfig, dims: ParallelDims, kind: str,
                       trainable: bool = True, packing: Packing = "none", forward_methods: bool = True) -> nn.Module:
    """One role's model over `worker`'s pool with the layout `dims` (tinyzero.distributed.parallel_dims), ready
    for its passes. `kind`: "causal_lm", "value" or "reward". The steps, in the order each needs:

    1. built on the meta device with its LoRA adapters (parameters FSDP2 must shard with their layers);
       only the mesh's source rank reads the weights (tinyzero.models.fsdp.load_sharded_model, steps 1-5);
    2. fused layers (model.use_fused_layers) replace RMSNorm / SwiGLU modules before anything wraps them;
    3. tensor parallelism over dims' tp axis turns the plain nn.Linear projections into DTensor shards;
    4. activation checkpointing wraps each decoder layer: after TP (the recomputed forward is the sharded
       one), before FSDP2 (its hooks stay outside the checkpoint);
    5. FSDP2 over the rest of the layout, each decoder layer then the root (it shards what the steps above
       made); the weights broadcast into the shards; CPU shared-memory collectives (tuning.shm_collectives);
    6. Ulysses sequence parallelism: attention becomes the all-to-all kernel (heads per TP shard must split
       over sp) and `model.sp_group` holds the group that splits a sequence (else None);
    7. a frozen role (`trainable=False`: reference, teacher, scoring reward model) tracks no gradients and
       may hold its weights in the compute dtype; trained ones keep fp32 master weights
       (tinyzero.models.precision);
    8. packed passes (`packing` != "none") switch attention to a kernel that takes the packed mask;
    9. `forward_methods`: the pass FSDP2 treats like forward, `token_log_probs` (causal LM) or
       `token_scores` (reward model); a value model's passes call forward itself."""
    from tinyzero.models.fsdp import load_sharded_model
    from tinyzero.workers.forward import attach_log_prob_method, attach_score_method
    from tinyzero.workers.packing import prepare_attention

    mesh = dims.build_mesh(worker.device_mesh)
    model = load_sharded_model(model_config, fsdp_config, dims.fsdp_mesh(mesh), kind=kind,
                               tp_mesh=dims.tp_mesh(mesh), trainable=trainable)
    model.sp_group = dims.sp_group(worker.device_mesh)
    if model.sp_group is not None:
        from tinyzero.models.ulysses import ULYSSES_ATTENTION, check_heads

        cfg = model.config
        check_heads(cfg.num_attention_heads // dims.tp,
                    (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // dims.tp, dims.sp)
        model.set_attn_implementation(ULYSSES_ATTENTION)
    if not trainable:
        model.requires_grad_(False)
    prepare_attention(model, packing)
    if forward_methods and kind == "causal_lm":
        model = attach_log_prob_method(model)
    elif forward_methods and kind == "reward":
        model = attach_score_method(model)
    return model


def offloads_params(fsdp_config: FSDPConfig) -> bool:
    """Parameters leave the device between phases (not under CPUOffloadPolicy, which keeps them on CPU)."""
    return fsdp_config.param_offload and not fsdp_config.offload_policy


def offloads_optimizer(fsdp_config: FSDPConfig) -> bool:
    return fsdp_config.optimizer_offload and not fsdp_config.offload_policy


@contextlib.contextmanager
def on_device(model: nn.Module, fsdp_config: FSDPConfig, device: torch.device,
              optimizer: torch.optim.Optimizer | None = None):
    """Parameters (and optimizer state when given) on `device` inside, offloaded after if configured."""
    from tinyzero.models.fsdp import load_fsdp_model, load_optimizer, offload_fsdp_model, offload_optimizer

    if offloads_params(fsdp_config):
        load_fsdp_model(model, device)
    if optimizer is not None and offloads_optimizer(fsdp_config):
        load_optimizer(optimizer, device)
    try:
        yield
    finally:
        if offloads_params(fsdp_config):
            offload_fsdp_model(model)
        if optimizer is not None and offloads_optimizer(fsdp_config):
            offload_optimizer(optimizer)


def base_only(model: nn.Module, enabled: bool = True):
    """The model with its LoRA adapters disabled inside (the reference policy), when `enabled`."""
    from tinyzero.models.lora import disable_adapters

    return disable_adapters(model) if enabled else contextlib.nullcontext(model)


def offload_after_init(model: nn.Module, fsdp_config: FSDPConfig,
                       optimizer: torch.optim.Optimizer | None = None) -> None:
    """Start offloaded when the config offloads between phases."""
    from tinyzero.models.fsdp import offload_fsdp_model, offload_optimizer

    if offloads_params(fsdp_config):
        offload_fsdp_model(model)
    if optimizer is not None and offloads_optimizer(fsdp_config):
        offload_optimizer(optimizer)


def reshard(model: nn.Module) -> None:
    """Free gathered parameters after a forward-only pass.

    FSDP2 keeps the root's parameters (embeddings, final norm, lm_head / head) gathered after a
    forward, expecting a backward; after inference that would hold a full copy of them, and
    `model.parameters()` would list the gathered tensors instead of the sharded ones.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def masked_mean_over_group(values: torch.Tensor, mask: torch.Tensor, group=None) -> float:
    """sum(values * mask) / sum(mask) over all rows of all ranks of `group`."""
    sums = torch.tensor([float((values * mask).sum()), float(mask.sum())], dtype=torch.float64)
    all_reduce_sum(sums, group)
    return float(sums[0] / sums[1].clamp(min=1.0))


def response_mask_of(data) -> torch.Tensor:
    """`response_mask` if present, else the response part of the attention mask."""
    if "response_mask" in data.batch:
        return data.batch["response_mask"].float()
    r = data.batch["responses"].shape[1]
    return data.batch["attention_mask"][:, -r:].float()


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory in GiB (0 on CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return 0.0


class TrainedModel:
    """What the actor and the critic share: one rank's FSDP2 model, its optimizer and lr schedule,
    and the data-parallel group its losses are scaled over."""

    def __init__(self, config, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler=None, dp_group=None, dp_size: int = 1, device: torch.device | None = None,
                 packing: Packing = "none"):
        if packing not in PACKINGS:
            raise ValueError(f"packing={packing!r} is not one of {PACKINGS}")
        self.config = config
        # How every training pass lays out its rows (tinyzero.workers.packing): "none" (padded rows),
        # "remove_padding" or "shared_prefix"; the worker takes it from the model config (packing_mode).
        self.packing = packing
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.num_updates = 0
        # The compute device; parameters may live elsewhere (CPU offload) between and during phases.
        self.device = torch.device(device) if device is not None else next(model.parameters()).device

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        """The optimizer's (sharded) parameters; model.parameters() may list gathered copies after a forward."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]
