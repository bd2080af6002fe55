"""One role's model / optimizer / lr-scheduler state in its folder (torch DCP: resharded on load).

    save_state(role_dir, model, optimizer, lr_scheduler, process_group=group, extra={"num_updates": 3})
    extra = load_state(role_dir, model, optimizer, lr_scheduler, process_group=group)

Called by the workers (workers/checkpointing.py) for the folder the trainer's CheckpointManager
hands each role; publishing a step atomically is the manager's job (trainer/checkpoint.py).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from tinyzero.runtime.fileio import atomic_write_text


def save_state(
    role_dir: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler=None,
    process_group: dist.ProcessGroup | None = None,
    extra: dict | None = None,
    trainable_only: bool = False,
) -> None:
    """Sharded save of model (+ optimizer) into `role_dir` by every rank of `process_group`.

    lr scheduler state and `extra` (JSON) are written once, by the group's first rank.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    os.makedirs(role_dir, exist_ok=True)
    state = _state_dicts(model, optimizer, trainable_only)
    use_dist = dist.is_initialized()
    dcp_save(state, storage_writer=FileSystemWriter(role_dir, sync_files=True),
             process_group=process_group, no_dist=not use_dist)
    group_rank = dist.get_rank(process_group) if use_dist else 0
    if group_rank == 0:
        if lr_scheduler is not None:
            torch.save(lr_scheduler.state_dict(), os.path.join(role_dir, "lr_scheduler.pt"))
        if extra is not None:
            atomic_write_text(os.path.join(role_dir, "extra_state.json"), json.dumps(extra))


def _state_dicts(model, optimizer, trainable_only: bool):
    """{"model": ..., "optim": ...} as DCP saves them; trainable_only keeps the trainable parameters only
    (LoRA adapters: the frozen base is read from the model folder)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tinyzero.distributed.full_params import clean_param_name

    model_sd, optim_sd = get_state_dict(model, [optimizer] if optimizer is not None else [])
    if trainable_only:
        keep = {clean_param_name(n) for n, p in model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in keep}
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    return state


def load_state(
    role_dir: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler=None,
    process_group: dist.ProcessGroup | None = None,
    trainable_only: bool = False,
) -> dict | None:
    """Load what `save_state` wrote into the (already sharded, any world size) model / optimizer.

    Returns the `extra` dict, or None if none was saved.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from tinyzero.models.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    if not os.path.isfile(os.path.join(role_dir, ".metadata")):
        raise ValueError(f"{role_dir!r} holds no DCP checkpoint (.metadata missing)")
    # Read (restricted) before DCP does, so a crafted or corrupt .metadata fails here in one clear line.
    saved_keys = SafeFileSystemReader(role_dir).read_metadata().state_dict_metadata
    if optimizer is not None:
        if not any(k.startswith("optim.") for k in saved_keys):
            raise ValueError(f"{role_dir!r} was saved without optimizer state; load it with optimizer=None "
                             "(the optimizer then starts fresh)")
    state = _state_dicts(model, optimizer, trainable_only)
    dcp_load(state, storage_reader=SafeFileSystemReader(role_dir), planner=SafeLoadPlanner(),
             process_group=process_group, no_dist=not dist.is_initialized())
    set_state_dict(model, [optimizer] if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}), options=StateDictOptions(strict=not trainable_only))
    if lr_scheduler is not None:
        path = os.path.join(role_dir, "lr_scheduler.pt")
        if not os.path.isfile(path):
            raise ValueError(f"{role_dir!r} has no lr_scheduler.pt but a scheduler was given")
        lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
    extra_path = os.path.join(role_dir, "extra_state.json")
    if os.path.isfile(extra_path):
        with open(extra_path) as f:
            return json.load(f)
    return None
