"""Export a (possibly FSDP2-sharded) model as a HF folder: safetensors + config + tokenizer.

    export_hf(model, out_dir, hf_config=model.config, tokenizer=tok)   # every rank of the model's mesh

Tensors are gathered one at a time (tinyzero.distributed.full_params's streamer), moved to CPU and handed to the
first rank, which writes them in safetensors shards of at most `max_shard_bytes` plus
`model.safetensors.index.json`; no rank ever holds the whole model on its accelerator, and
rank 0 holds at most one shard on CPU. Tied weights are written once (as `save_pretrained`
does). The folder is written under `<out_dir>.tmp-XXXX` and renamed, so a crash never leaves
a half-written export at `out_dir`. The result loads with `AutoModelForCausalLM.from_pretrained`
and vLLM.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from tinyzero.distributed.full_params import iter_full_params, named_tensors


def iter_export_tensors(model: nn.Module, dtype: torch.dtype | None = None):
    """Yield (hf_name, full CPU tensor) for every persistent tensor, tied duplicates once. Collective.

    The weight-sync streamer gathers them (one tensor per bucket: one full tensor alive at a time);
    `dtype` casts the floating-point ones."""
    tied = {name for names, _ in named_tensors(model) for name in names[1:]}  # save_pretrained writes them once
    for name, full in iter_full_params(model, bucket_bytes=1):
        if name in tied:
            continue
        full = full.detach()
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        yield name, full.to("cpu", copy=True).contiguous()


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def export_hf(
    model: nn.Module,
    out_dir: str,
    hf_config=None,
    tokenizer=None,
    generation_config=None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    process_group: dist.ProcessGroup | None = None,
) -> str:
    """Write `model` as a HF folder at `out_dir` (called by every rank of the model's process group)."""
    from safetensors.torch import save_file

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    writer = _rank(process_group) == 0
    out_dir = os.path.abspath(out_dir)
    tmp = None
    if writer:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=os.path.dirname(out_dir))
    hf_config = hf_config if hf_config is not None else getattr(model, "config", None)

    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0
    total_bytes = 0

    def flush():
        nonlocal current, current_bytes
        if current:
            idx = len(shards)
            save_file(current, os.path.join(tmp, f"part-{idx:05d}.safetensors"), metadata={"format": "pt"})
            shards.append(list(current))
            current, current_bytes = {}, 0

    for name, tensor in iter_export_tensors(model, dtype):
        if not writer:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if current and current_bytes + nbytes > max_shard_bytes:
            flush()
        current[name] = tensor
        current_bytes += nbytes
        total_bytes += nbytes
    if writer:
        flush()
        _finish_files(tmp, shards, total_bytes)
        if hf_config is not None:
            cfg = copy.deepcopy(hf_config)
            cfg.use_cache = True  # training turns it off for activation checkpointing
            if dtype is not None:
                cfg.dtype = dtype
            cfg.save_pretrained(tmp)
        if generation_config is None and getattr(model, "can_generate", lambda: False)():
            generation_config = getattr(model, "generation_config", None)  # eos ids for vLLM / generate()
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        old = None
        if os.path.exists(out_dir):
            old = out_dir + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier(group=process_group)
    return out_dir


def _finish_files(tmp: str, shards: list[list[str]], total_bytes: int) -> None:
    """Rename parts to HF's file names; write the index when there is more than one file."""
    n = len(shards)
    if n == 1:
        os.replace(os.path.join(tmp, "part-00000.safetensors"), os.path.join(tmp, "model.safetensors"))
        return
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(tmp, f"part-{i:05d}.safetensors"), os.path.join(tmp, fname))
        weight_map.update({k: fname for k in names})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
