"""Checkpoint glue of the workers: one role's state in and out of its folder.

The folder format is tinyzero.models.role_state's `save_state` / `load_state`: DCP shards of
the model and optimizer (resharded on load, so the number of ranks may change), the lr
scheduler and a small JSON of extra state (the update counter, which also seeds the
mini-batch shuffle). Atomic publication of a step, keeping the last K and the RNG states
of every rank are the trainer checkpoint manager's job; it hands each role its folder.
"""

from __future__ import annotations

import os

CONTENT_NAMES = ("model", "optimizer", "extra", "hf_model")


def save_role(worker, role, local_path: str, global_step: int, contents: list[str]) -> None:
    """Write `role`'s (a PPOActor / PPOCritic) model, optimizer and lr scheduler into local_path."""
    from tinyzero.models.role_state import save_state

    if "model" not in contents:
        raise ValueError(f"checkpoint.contents={contents} must include 'model'")
    optimizer = role.optimizer if "optimizer" in contents else None
    scheduler = role.lr_scheduler if "extra" in contents else None
    extra = {"global_step": int(global_step), "num_updates": int(role.num_updates)}
    save_state(local_path, role.model, optimizer, scheduler, process_group=worker.process_group, extra=extra,
               trainable_only=_is_lora(role.model))
    if "hf_model" in contents:
        export_hf(worker, role.model, os.path.join(local_path, "huggingface"), getattr(worker, "tokenizer", None))


def load_role(worker, role, local_path: str) -> None:
    """Restore what save_role wrote; the optimizer and scheduler only when they were saved."""
    from tinyzero.models.role_state import load_state

    if not os.path.isfile(os.path.join(local_path, ".metadata")):
        raise ValueError(f"{local_path!r} is not a worker checkpoint folder (no DCP .metadata); pass the "
                         f"role folder, e.g. <checkpoint>/global_step_N/actor")
    has_sched = os.path.isfile(os.path.join(local_path, "lr_scheduler.pt"))
    optimizer = role.optimizer if _has_optimizer_state(local_path) else None
    extra = load_state(local_path, role.model, optimizer, role.lr_scheduler if has_sched else None,
                       process_group=worker.process_group, trainable_only=_is_lora(role.model))
    if extra is not None:
        role.num_updates = int(extra.get("num_updates", role.num_updates))


def _has_optimizer_state(local_path: str) -> bool:
    from tinyzero.models.safe_dcp import SafeFileSystemReader

    meta = SafeFileSystemReader(local_path).read_metadata()
    return any(key.startswith("optim.") for key in meta.state_dict_metadata)


def _is_lora(model) -> bool:
    from tinyzero.models.lora import has_lora

    return has_lora(model)


def export_hf(worker, model, out_dir: str, tokenizer=None) -> str:
    """HF folder (safetensors + config + tokenizer) from the sharded model, written by the pool's first rank.

    A LoRA model is written as a PEFT adapter folder (+ tokenizer), and with model.lora_export_merged
    also as the merged HF model in `<out_dir>/merged`."""
    from tinyzero.models.hf_export import export_hf as _export

    if _is_lora(model):
        return _export_lora(worker, model, out_dir, tokenizer)
    return _export(model, out_dir, hf_config=getattr(model, "config", None), tokenizer=tokenizer,
                   process_group=worker.process_group)


def _export_lora(worker, model, out_dir: str, tokenizer=None) -> str:
    import torch.distributed as dist

    from tinyzero.models import lora
    from tinyzero.models.hf_export import export_hf as _export

    model_config = worker.config.model
    lora.save_adapter(model, out_dir, lora.LoraSpec.from_model_config(model_config), model_config.path,
                      process_group=worker.process_group)
    if tokenizer is not None and (not dist.is_initialized() or dist.get_rank(worker.process_group) == 0):
        tokenizer.save_pretrained(out_dir)
    if model_config.lora_export_merged:
        with lora.merged_in_place(model):
            _export(model, os.path.join(out_dir, "merged"), hf_config=getattr(model, "config", None),
                    tokenizer=tokenizer, process_group=worker.process_group)
    return out_dir
