"""FSDP2 (`fully_shard`) applied to a HF model from outside, plus init and offload helpers.

    mesh = make_fsdp_mesh(fsdp_config, "cpu")                  # or the worker's pool mesh
    model = load_sharded_model(model_config, fsdp_config, mesh) # meta init, rank 0 reads, broadcast
    ...
    offload_fsdp_model(model); offload_optimizer(optim)         # between phases (param_offload)
    load_fsdp_model(model, device); load_optimizer(optim, device)

Layout: every decoder layer is its own FSDP unit and the root (embeddings, final norm,
lm_head / score head) is the last; a 1-D mesh ("dp_shard",) shards over all its ranks, a 2-D mesh
("dp_replicate", "dp_shard") is hybrid sharding (HSDP): shard within dim 1, replicate across dim 0
(tinyzero.distributed.parallel_dims.ParallelDims owns the layout).
Dtypes come from tinyzero.models.precision: a trained model's parameters stay fp32 (master weights),
MixedPrecisionPolicy casts them to bf16 for compute on GPU and reduces gradients in fp32; on CPU
everything is fp32.
On CPU ranks of one x86 host the units' all-gathers and reduce-scatters go through a shared-memory
segment (tinyzero.distributed.shm_comm, `tuning.shm_collectives`) instead of gloo's TCP loopback.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from tinyzero.distributed import collective_timeout_s
from tinyzero.distributed.parallel_dims import ParallelDims
from tinyzero.distributed.shm_comm import shm_collectives_enabled, use_shm_collectives
from tinyzero.models.config import FSDPConfig, ModelConfig
from tinyzero.models.loading import check_model_path, load_model, pick_attn_implementation
from tinyzero.models.precision import PrecisionPolicy, check_trained_dtypes, compute_dtypes, resolve_precision

_KINDS = ("causal_lm", "value", "reward")


def make_fsdp_mesh(fsdp_config: FSDPConfig, device_type: str, world_size: int | None = None) -> DeviceMesh:
    """An FSDP2 mesh over the whole world (tinyzero.distributed.parallel_dims lays it out; a worker builds the same over
    its pool with ParallelDims.build_mesh(worker.device_mesh))."""
    dims = ParallelDims.for_role(world_size or dist.get_world_size(), fsdp_config.fsdp_size)
    return dims.build_mesh(lambda shape, names: init_device_mesh(device_type, shape, mesh_dim_names=names))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a HF model (by its `_no_split_modules` classes, else a `layers` list)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    for m in model.modules():
        for attr in ("layers", "h", "blocks"):
            sub = getattr(m, attr, None)
            if isinstance(sub, nn.ModuleList) and len(sub) > 0:
                return list(sub)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def mixed_precision_policy(fsdp_config: FSDPConfig, device_type: str) -> MixedPrecisionPolicy:
    """bf16 compute / fp32 reduce on GPU by default; fp32 throughout on CPU."""
    param_dtype, reduce_dtype, output_dtype = compute_dtypes(fsdp_config, device_type)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype,
                                cast_forward_inputs=True)


def enable_activation_checkpointing(model: nn.Module, every_n_layers: int = 1) -> None:
    """Recompute decoder layers 0, n, 2n, ... in backward (non-reentrant), n = `every_n_layers`; the
    others keep their activations. Keeps parameter names unchanged."""
    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "config"):
            model.config.use_cache = False
        if every_n_layers > 1:
            for i, layer in enumerate(decoder_layers(model)):
                if hasattr(layer, "gradient_checkpointing"):
                    layer.gradient_checkpointing = i % every_n_layers == 0
        return
    raise ValueError(f"{type(model).__name__} does not support gradient checkpointing; "
                     "set model.enable_gradient_checkpointing=False")


def parallelize(model: nn.Module, mesh: DeviceMesh, fsdp_config: FSDPConfig,
                enable_gradient_checkpointing: bool = False, tp_mesh: DeviceMesh | None = None,
                checkpoint_every_n_layers: int = 1, precision: PrecisionPolicy | None = None) -> nn.Module:
    """Apply fully_shard to every decoder layer and then the root; return the (same) model object.

    `precision` (tinyzero.models.precision) gives the compute / reduce dtypes; None takes them from
    `fsdp_config.mixed_precision` on the mesh's device.

    With `tp_mesh` (1-D, sliced from the same parent mesh as `mesh`), tensor parallelism
    (models.tensor_parallel) is applied first and FSDP2 shards the DTensors over `mesh` (2-D FSDP + TP).
    """
    if tp_mesh is not None:
        from tinyzero.models.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tp_mesh)
    if enable_gradient_checkpointing:
        enable_activation_checkpointing(model, checkpoint_every_n_layers)
    mp_policy = precision.mp_policy() if precision is not None else mixed_precision_policy(fsdp_config,
                                                                                            mesh.device_type)
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if fsdp_config.offload_policy else OffloadPolicy()
    )
    min_params = fsdp_config.wrap_policy.min_num_params
    layers = [layer for layer in decoder_layers(model) if sum(p.numel() for p in layer.parameters()) >= min_params]
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by backward: keep them gathered.
        reshard = fsdp_config.reshard_after_forward and i < len(layers) - 1
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
    # The root (embeddings, final norm, head, and the layers left to it) is never resharded after forward:
    # backward needs the head first and the input embeddings last, so it holds the root gathered from its
    # start to its end anyway; resharding in between would only cost one more all-gather. Forward-only
    # passes free it explicitly (workers.common.reshard).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload)
    if shm_collectives_enabled():
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        use_shm_collectives(units, mesh.get_group(mesh.ndim - 1), torch.device(mesh.device_type), collective_timeout_s())
    return model


# --------------------------------------------------------------------------- meta init + broadcast


def _is_mesh_source(*meshes: DeviceMesh | None) -> bool:
    return all(c == 0 for m in meshes if m is not None for c in m.get_coordinate())


def mesh_broadcast(tensor: torch.Tensor, mesh: DeviceMesh, *more: DeviceMesh | None) -> None:
    """Broadcast `tensor` in place from mesh coordinate (0, ..., 0) to every rank of the mesh.

    One broadcast per mesh dim, from the rank at local index 0 of that dim; dim d only runs on ranks whose
    coordinates after d are all 0 (they already hold the data), so it works on any sub-mesh / pool group.
    `more` meshes (e.g. the tensor-parallel axis beside the FSDP mesh) add their dims after `mesh`'s:
    the broadcast then covers the product of all of them.
    """
    meshes = [m for m in (mesh, *more) if m is not None]
    coord = [c for m in meshes for c in m.get_coordinate()]
    axes = [(m, d) for m in meshes for d in range(m.ndim)]
    for i, (m, d) in enumerate(axes):
        if all(c == 0 for c in coord[i + 1:]) and m.size(d) > 1:
            dist.broadcast(tensor, group=m.get_group(d), group_src=0)


def _build(kind: str, path: str, model_config: ModelConfig, device: str | torch.device, dtype: torch.dtype,
           adapter_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None):
    # The CPU copy only supplies weights: give it a kernel that exists on CPU whatever the config asks for.
    if torch.device(device).type == "cpu":
        attn = "sdpa"
    else:  # "auto" decided for the compute dtype: flash-attn only under bf16 / fp16 compute
        target = "cuda" if torch.cuda.is_available() else "cpu"
        attn = pick_attn_implementation(target, model_config.attn_implementation, compute_dtype)
    kwargs = dict(dtype=dtype, device=device, attn_implementation=attn,
                  trust_remote_code=model_config.trust_remote_code, override_config=model_config.override_config)
    if kind == "causal_lm":
        model = load_model(path, "causal_lm", **kwargs)
        if model_config.lora_rank:  # before fully_shard, so adapters shard with their layers
            from tinyzero.models.lora import LoraSpec, apply_lora

            apply_lora(model, LoraSpec.from_model_config(model_config), adapter_dtype,
                       init=torch.device(device).type != "meta")
        return model
    if model_config.lora_rank:
        raise ValueError(f"model.lora_rank={model_config.lora_rank} applies to the actor only; set it to 0 "
                         f"for the {kind} model")
    from tinyzero.models.value import load_reward_model, load_value_model

    return (load_value_model if kind == "value" else load_reward_model)(path, **kwargs)


def _comm_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


@torch.no_grad()
def broadcast_into_sharded(model: nn.Module, full_state: dict[str, torch.Tensor] | None, mesh: DeviceMesh,
                           tp_mesh: DeviceMesh | None = None) -> None:
    """Fill a materialized FSDP2 model from a full state dict that only the mesh source rank holds.

    Parameters go one tensor at a time: broadcast the full tensor over the mesh (and `tp_mesh`), keep the
    local shard (by the DTensor's own mesh and placements, FSDP x TP included).
    Buffers (e.g. rotary inv_freq, not in checkpoints) are broadcast whole.
    """
    is_src = _is_mesh_source(mesh, tp_mesh)
    comm_device = _comm_device(mesh)
    items = list(model.named_parameters()) + list(model.named_buffers())
    for name, tensor in items:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        full_shape = tensor.shape
        buf = torch.empty(full_shape, dtype=tensor.dtype, device=comm_device)
        if is_src:
            if name not in full_state:
                raise ValueError(f"loaded model has no tensor {name!r} (architecture mismatch?)")
            src = full_state[name]
            if src.shape != full_shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(full_shape)}")
            buf.copy_(src)
        mesh_broadcast(buf, mesh, tp_mesh)
        if isinstance(tensor, DTensor):
            shard = distribute_tensor(buf, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            local.copy_(shard)
        else:
            local.copy_(buf)


def load_sharded_model(
    model_config: ModelConfig,
    fsdp_config: FSDPConfig,
    mesh: DeviceMesh,
    kind: str = "causal_lm",
    dtype: str | torch.dtype | None = None,
    tp_mesh: DeviceMesh | None = None,
    trainable: bool = True,
) -> nn.Module:
    """Build `kind` ("causal_lm" | "value" | "reward") on the meta device, shard it, load weights.

    `tp_mesh`: the tensor-parallel axis (1-D, from the same parent mesh as `mesh`); see `parallelize`.
    `trainable`: an optimizer will update this model; its dtypes then follow the training precision
    policy (fp32 master weights, tinyzero.models.precision). Frozen roles pass False. `dtype`
    overrides `model_config.dtype`.

    Only the mesh source rank reads the weight files (on CPU); every tensor is broadcast over the
    mesh and each rank keeps its shard, so N ranks never read the checkpoint N times.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r}: use one of {_KINDS}")
    path = check_model_path(model_config.path)
    # Decided for the device the model computes on (mesh.device_type), the same on every rank.
    precision = resolve_precision(model_config, fsdp_config, mesh.device_type, trainable, dtype)
    dtype = precision.master_dtype
    full_state, error = None, None
    if _is_mesh_source(mesh, tp_mesh):
        try:
            full = _build(kind, path, model_config, "cpu", dtype, precision.adapter_dtype)
            full_state = dict(full.named_parameters()) | dict(full.named_buffers())
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
            error = e
    # Tell every rank whether the source could read the weights, so a bad file fails all ranks at once
    # instead of leaving them waiting in the first broadcast.
    failed = torch.tensor([error is not None], dtype=torch.int32, device=_comm_device(mesh))
    mesh_broadcast(failed, mesh, tp_mesh)
    if error is not None:
        raise error
    if failed.item():
        raise ValueError(f"the first rank of the model's mesh could not load {path!r}; see its error")
    model = _build(kind, path, model_config, "meta", dtype, precision.adapter_dtype, precision.compute_dtype)
    if getattr(model_config, "use_fused_layers", False):
        if tp_mesh is not None and tp_mesh.size() > 1:
            raise ValueError("model.use_fused_layers works on plain tensors, not under tensor parallelism; "
                             "set model.use_fused_layers=false or tensor_model_parallel_size=1")
        from tinyzero.models.fused_layers import apply_fused_layers

        apply_fused_layers(model)
    parallelize(model, mesh, fsdp_config, enable_gradient_checkpointing=model_config.enable_gradient_checkpointing,
                tp_mesh=tp_mesh, checkpoint_every_n_layers=model_config.gradient_checkpointing_every_n_layers,
                precision=precision)
    target = torch.device("cpu") if fsdp_config.offload_policy else _comm_device(mesh)
    model.to_empty(device=target)
    broadcast_into_sharded(model, full_state, mesh, tp_mesh)
    del full_state
    if trainable:
        check_trained_dtypes(model, precision)
    if hasattr(model, "tie_weights") and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        _check_tied(model)
    return model


def _check_tied(model: nn.Module) -> None:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out is not None and inp is not None:
        assert out.weight is inp.weight, "tied embeddings came apart during sharding"


# --------------------------------------------------------------------------- offload between phases


@torch.no_grad()
def offload_fsdp_model(model: nn.Module) -> None:
    """Move an FSDP2 model's sharded parameters and gradients to CPU (between phases)."""
    _move_model(model, torch.device("cpu"))


@torch.no_grad()
def load_fsdp_model(model: nn.Module, device: torch.device | str) -> None:
    """Bring the sharded parameters and gradients back to `device`."""
    _move_model(model, torch.device(device))


def _move_model(model: nn.Module, device: torch.device) -> None:
    if isinstance(model, FSDPModule):
        model.reshard()
    model.to(device)
    for p in model.parameters():
        if p.grad is not None and p.grad.device != device:
            p.grad = p.grad.to(device)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def offload_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Move optimizer state tensors to CPU (0-dim tensors such as Adam's `step` stay where they are)."""
    _move_optimizer(optimizer, torch.device("cpu"))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def load_optimizer(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move optimizer state tensors back to `device` before `step()`."""
    _move_optimizer(optimizer, torch.device(device))


def _move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                state[key] = value.to(device, non_blocking=device.type == "cpu")
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
