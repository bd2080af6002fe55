"""Checkpoint glue of the workers: one role's sharded state in and out of a folder.

A role's folder holds the torch.distributed.checkpoint (DCP) shards of the model and the
optimizer (resharded on load, so the number of ranks may change) and one small file per
rank with the lr scheduler, the update counter and the RNG states. Atomic publication of
a step (write elsewhere, then rename), keeping the last K steps and resume discovery are
the trainer's checkpoint manager's job; it hands each role its folder.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

EXTRA_FILE = "extra_state_rank_{rank}.pt"
SHARDS_DIR = "shards"


def rng_state() -> dict:
    """RNG states as tensors and plain values, so they load with torch.load(weights_only=True)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def save_role(worker, role, local_path: str, global_step: int, max_ckpt_to_keep: int | None,
              contents: list[str]) -> None:
    """Write `role`'s (a PPOActor / PPOCritic) model, optimizer and extra state under local_path."""
    del max_ckpt_to_keep  # retention is the trainer checkpoint manager's job
    os.makedirs(local_path, exist_ok=True)
    state = {}
    with_optim = "optimizer" in contents and role.optimizer is not None
    model_sd, optim_sd = get_state_dict(role.model, role.optimizer if with_optim else [])
    if "model" in contents:
        state["model"] = model_sd
    if with_optim:
        state["optimizer"] = optim_sd
    if state:
        dcp.save(state, checkpoint_id=os.path.join(local_path, SHARDS_DIR), process_group=worker.process_group)
    if "extra" in contents:
        extra = {"global_step": global_step, "num_updates": role.num_updates, "rng": rng_state(),
                 "lr_scheduler": role.lr_scheduler.state_dict() if role.lr_scheduler is not None else None}
        torch.save(extra, os.path.join(local_path, EXTRA_FILE.format(rank=worker.rank)))
    if "hf_model" in contents:
        export_hf(worker, role.model, os.path.join(local_path, "huggingface"), getattr(worker, "tokenizer", None))
    _barrier(worker.process_group)


def load_role(worker, role, local_path: str) -> None:
    """Restore what save_role wrote (DCP reshards model and optimizer to the current ranks)."""
    shards = os.path.join(local_path, SHARDS_DIR)
    if not os.path.isdir(shards):
        raise ValueError(f"checkpoint folder {local_path!r} has no {SHARDS_DIR}/ (not a worker checkpoint?)")
    meta = dcp.FileSystemReader(shards).read_metadata()
    saved = {key.split(".", 1)[0] for key in meta.state_dict_metadata}
    with_optim = "optimizer" in saved and role.optimizer is not None
    model_sd, optim_sd = get_state_dict(role.model, role.optimizer if with_optim else [])
    state = {"model": model_sd}
    if with_optim:
        state["optimizer"] = optim_sd
    dcp.load(state, checkpoint_id=shards, process_group=worker.process_group)
    set_state_dict(role.model, role.optimizer if with_optim else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}), options=StateDictOptions(strict=True))
    extra_file = os.path.join(local_path, EXTRA_FILE.format(rank=worker.rank))
    if not os.path.isfile(extra_file):  # a different number of ranks: fall back to rank 0's
        extra_file = os.path.join(local_path, EXTRA_FILE.format(rank=0))
    if os.path.isfile(extra_file):
        extra = torch.load(extra_file, weights_only=True)
        role.num_updates = extra["num_updates"]
        if role.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            role.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        set_rng_state(extra["rng"])
    _barrier(worker.process_group)


def export_hf(worker, model, out_dir: str, tokenizer=None) -> None:
    """HF folder (safetensors + config + tokenizer) written by the pool's first rank."""
    from safetensors.torch import save_file

    from tinyzero.rollout.weight_sync import iter_full_params

    tensors = {}
    for name, tensor in iter_full_params(model, 256 * 2**20):
        if worker.rank == 0:
            tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
    if worker.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    _barrier(worker.process_group)
