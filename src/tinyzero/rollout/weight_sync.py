"""Stream full parameters out of a training model, one bounded bucket at a time.

`iter_full_params(model, bucket_bytes)` walks the parameters (and persistent buffers) in
registration order, groups them into buckets of about `bucket_bytes` (full size), gathers
one bucket (`DTensor.full_tensor()` for FSDP2 shards: a collective every rank of the mesh
must enter in the same order, which the fixed walk guarantees) and yields its
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


def _gather(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    if hasattr(t, "full_tensor"):  # DTensor (FSDP2 / TP shard)
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


def iter_full_params(model: nn.Module, bucket_bytes: int = 512 << 20,
                     dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every state-dict entry, gathering `bucket_bytes` at a time.

    Tied names share one gathered tensor. dtype: cast the gathered tensors (e.g. bf16 for a bf16
    engine) to halve what a bucket holds."""
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be >= 1 (rollout.weight_sync_bucket_mb sets it)")
    bucket: list[tuple[list[str], torch.Tensor]] = []
    size = 0
    for names, t in named_tensors(model):
        nbytes = _full_nbytes(t)
        if bucket and size + nbytes > bucket_bytes:
            yield from _emit(bucket, dtype)
            bucket, size = [], 0
        bucket.append((names, t))
        size += nbytes
    if bucket:
        yield from _emit(bucket, dtype)


def _emit(bucket: list[tuple[list[str], torch.Tensor]],
          dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    gathered = [(names, _gather(t, dtype)) for names, t in bucket]
    bucket.clear()
    while gathered:
        names, full = gathered.pop(0)
        for name in names:
            yield name, full
        del full
