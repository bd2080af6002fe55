"""Stream full parameters out of a training model, one bounded bucket at a time.

`iter_full_params(model, bucket_bytes)` walks the parameters (and persistent buffers) in
registration order, groups them into buckets of about `bucket_bytes` (full size), gathers
one bucket (FSDP2 Shard(0) parameters of one mesh with a single all_gather_into_tensor,
other DTensors with `full_tensor()`: collectives every rank of the mesh must enter in the
same order, which the fixed walk guarantees) and yields its
(hf_name, full_tensor) pairs before gathering the next. A consumer that does not keep the
tensors (engine.update_weights copies them) holds at most one bucket of gathered weights;
the whole model never materializes on one rank. A single tensor larger than the bucket is
its own bucket.

Names are HF names: the prefixes added by torch.compile (`_orig_mod.`), activation
checkpointing (`_checkpoint_wrapped_module.`), FSDP1 (`_fsdp_wrapped_module.`) and DDP
(`module.`) are stripped. Tied weights are gathered once and yielded under each of their
names, so the stream carries exactly the model's state_dict keys (vLLM's reload needs lm_head).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from tinyzero.distributed.shm_comm import comm_for

WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def clean_param_name(name: str) -> str:
    """HF name of a parameter of a wrapped / compiled model."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if name.startswith("module."):
        name = name[len("module."):]
    return name


def _full_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # DTensor numel is the global size


def _offloaded(t: torch.Tensor) -> bool:
    """A DTensor whose shard lives off its mesh's device (FSDP2 CPUOffloadPolicy)."""
    return hasattr(t, "device_mesh") and t.device.type != t.device_mesh.device_type


def _gather(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    if hasattr(t, "full_tensor"):  # DTensor (FSDP2 / TP shard)
        if _offloaded(t):  # gather on the mesh's device
            mesh_type = t.device_mesh.device_type
            t = t.to(torch.device(mesh_type, torch.cuda.current_device()) if mesh_type == "cuda" else mesh_type)
        t = t.full_tensor()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t


def named_tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """([clean names], tensor) for parameters and persistent buffers; tied tensors appear once with all
    their names (e.g. Qwen2.5's embed_tokens.weight and lm_head.weight), so they are gathered once."""
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ([], p))[0].append(clean_param_name(name))
    non_persistent = {
        f"{mod_name}.{b}" if mod_name else b
        for mod_name, mod in model.named_modules() for b in getattr(mod, "_non_persistent_buffers_set", ())
    }
    for name, b in model.named_buffers(remove_duplicate=False):
        if name not in non_persistent:
            by_id.setdefault(id(b), ([], b))[0].append(clean_param_name(name))
    out = []
    for names, t in by_id.values():
        unique = list(dict.fromkeys(names))
        out.append((unique, t))
    return out


def iter_full_params(model: nn.Module, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None,
                     include=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every state-dict entry, gathering `bucket_bytes` at a time.

    Tied names share one gathered tensor. dtype: cast the gathered tensors (e.g. bf16 for a bf16
    engine) to halve what a bucket holds. include: a predicate on the first name; only the tensors
    it accepts are gathered (e.g. LoRA adapters only)."""
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be >= 1 (rollout.weight_sync_bucket_mb sets it)")
    bucket: list[tuple[list[str], torch.Tensor]] = []
    size = 0
    for names, t in named_tensors(model):
        if include is not None and not include(names[0]):
            continue
        nbytes = _full_nbytes(t)
        if bucket and size + nbytes > bucket_bytes:
            yield from _emit(bucket, dtype)
            bucket, size = [], 0
        bucket.append((names, t))
        size += nbytes
    if bucket:
        yield from _emit(bucket, dtype)


def _dim0_shard_group(t: torch.Tensor):
    """The process group a DTensor is sharded over if it is FSDP2-style (Shard(0) on the last mesh dim,
    replicated on any others), else None."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor) or t.ndim == 0 or _offloaded(t):
        return None
    *outer, last = t.placements
    if last != Shard(0) or any(p != Replicate() for p in outer):
        return None
    return t.device_mesh.get_group(t.device_mesh.ndim - 1)


def _gather_dim0_bucket(tensors: list[torch.Tensor], group,
                        dtype: torch.dtype | None) -> Iterator[torch.Tensor]:
    """Gather Shard(0) DTensors of one mesh with a single all_gather_into_tensor; yield them in order.

    DTensor splits dim 0 like torch.chunk: rank r holds rows [r*c, min((r+1)*c, n)) with c = ceil(n / world),
    so only trailing ranks are short. Each rank writes its shards, padded to c rows, straight into its
    own slot of the output buffer (an in-place all-gather); the first n rows of the ranks' padded chunks
    laid end to end are the full tensor. A bucket of one tensor is yielded as a view of the buffer;
    otherwise each tensor is copied out when the consumer asks for it, so at most the buffer plus one
    tensor is alive."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out_dtype = dtype or tensors[0].dtype
    layout, width = [], 0
    for t in tensors:
        c = -(-t.shape[0] // world)
        row = int(torch.Size(t.shape[1:]).numel())
        layout.append((width, t.shape[0], c, t.shape[1:]))
        width += c * row
    out = torch.zeros(world, width, dtype=out_dtype, device=tensors[0].to_local().device)
    mine = out[rank]
    for t, (start, _, _, _) in zip(tensors, layout):
        local = t.to_local().detach().reshape(-1)
        mine[start:start + local.numel()].copy_(local)
    comm = comm_for(group)  # the FSDP2 modules' shared-memory segment on one CPU host
    if comm is not None:
        comm.all_gather_into(out.view(-1), mine)
    else:
        # all_gather_single is the newer name of all_gather_into_tensor (deprecated in recent torch).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), mine, group=group)
    if len(tensors) == 1:
        _, n, c, rest = layout[0]
        yield out.view(world * c, *rest)[:n]
        return
    for start, n, c, rest in layout:
        row = int(torch.Size(rest).numel())
        yield out[:, start:start + c * row].reshape(world * c, *rest)[:n]  # strided: reshape copies
    del out


def _gather_bucket(tensors: list[torch.Tensor], dtype: torch.dtype | None) -> Iterator[torch.Tensor]:
    """Full tensors of one bucket, in order: one collective for FSDP2 shards of a single mesh,
    `DTensor.full_tensor()` per tensor otherwise, plain tensors as they are."""
    groups = {_dim0_shard_group(t) for t in tensors}
    dtypes = {t.dtype for t in tensors}
    if len(groups) == 1 and None not in groups and (dtype is not None or len(dtypes) == 1):
        yield from _gather_dim0_bucket(tensors, groups.pop(), dtype)
        return
    gathered = [_gather(t, dtype) for t in tensors]  # every collective before the first yield
    while gathered:
        yield gathered.pop(0)


def _emit(bucket: list[tuple[list[str], torch.Tensor]],
          dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    tensors = [t for _, t in bucket]
    names = [n for n, _ in bucket]
    bucket.clear()
    for tensor_names, full in zip(names, _gather_bucket(tensors, dtype)):
        for name in tensor_names:
            yield name, full
        del full
