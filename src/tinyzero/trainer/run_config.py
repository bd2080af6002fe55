"""The run folder's config.yaml: refuse a resume whose config changes the training, keep the history.

    write_config(cfg, run_dir, saved_path)   # rank 0; raises ConfigError naming the changed fields
                                             # (or a name in reliability.allow_config_change that is no field)

Resuming with another batch size, learning rate, seed or model gives a run that is neither the
old one nor a new one, so a resume compares the new config with the saved one and refuses
changes to anything but the settings in SAFE_TO_CHANGE / SAFE_SUFFIXES (logging, validation, run
length, checkpoint cadence, timeouts, micro-batching, memory and offload settings) unless
`reliability.allow_config_change` names them (or says "all"). An earlier config.yaml that differs is kept as config.<N>.yaml (N counting up); config.yaml is
always the latest.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings

import yaml

from tinyzero.config import ConfigError
from tinyzero.config.parse import dump_yaml, to_dict

CONFIG_FILE = "config.yaml"
_NUMBERED_RE = re.compile(r"^config\.(\d+)\.yaml$")

# Fields that may change between a run and its resume without changing what is trained.
SAFE_TO_CHANGE = {f"trainer.{name}" for name in (
    "project_name", "experiment_name", "logger", "default_local_dir", "total_epochs", "total_training_steps",
    "test_freq", "val_before_train", "val_only", "save_freq", "resume_mode", "resume_from_path", "max_ckpt_to_keep",
    "export_hf", "log_samples", "log_val_generations", "progress_bar", "plot")} | {
    "data.val_files", "data.val_batch_size",
}
# Any field under these prefixes, or ending in these names: the schedule length follows the run length;
# micro-batching is exact under any split (workers/scaling.py); memory, offload, sharding and kernel
# choices, worker counts and time limits change how the same math runs, not the math.
SAFE_PREFIXES = ("actor_rollout_ref.rollout.val_kwargs.", "tuning.", "reliability.")
SAFE_SUFFIXES = (
    ".optim.total_training_steps", "micro_batch_size_per_gpu", "max_token_len_per_gpu", "use_dynamic_bsz",
    ".enable_gradient_checkpointing", ".gradient_checkpointing_every_n_layers", ".attn_implementation", ".gpu_memory_utilization", ".cpu_kv_cache_mb",
    ".enforce_eager", ".free_cache_engine", ".native_compile", ".param_offload", ".optimizer_offload",
    ".offload_policy", ".reshard_after_forward", ".fsdp_size", ".num_workers", "timeout_s", "trainer.device",
)


def _flatten(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _safe(name: str) -> bool:
    return name in SAFE_TO_CHANGE or name.startswith(SAFE_PREFIXES) or name.endswith(SAFE_SUFFIXES)


def changed_fields(old: dict, new: dict) -> dict[str, tuple]:
    """{field: (old, new)} of fields present in both configs whose values differ (nested dicts compared flat)."""
    a, b = _flatten(old), _flatten(new)
    return {k: (a[k], b[k]) for k in a.keys() & b.keys() if a[k] != b[k]}


def allowed_changes(cfg) -> set[str]:
    """The names in reliability.allow_config_change: "all" or fields of the config; anything else (a typo, a
    mode that does not exist) is a ConfigError naming the valid forms."""
    allowed = {x.strip() for x in cfg.reliability.allow_config_change.split(",") if x.strip()}
    fields = _flatten(to_dict(cfg))
    for name in sorted(allowed - {"all"} - fields.keys()):
        close = difflib.get_close_matches(name, list(fields) + ["all"], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"reliability.allow_config_change: {name!r} is neither a config field nor 'all'{hint}; give "
                          "'all' (accept every change) or the changed fields, comma-separated, as the refusal "
                          "names them (e.g. data.train_batch_size,actor_rollout_ref.actor.optim.lr)")
    return allowed


def check_resume_config(saved_path: str, cfg) -> None:
    """Raise ConfigError if `cfg` changes fields of the config at `saved_path` that alter the training."""
    try:
        with open(saved_path) as f:
            old = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        warnings.warn(f"cannot compare the resumed config with {saved_path} ({e}); continuing", stacklevel=2)
        return
    if not isinstance(old, dict):
        return
    new = yaml.safe_load(yaml.safe_dump(to_dict(cfg)))  # the same round trip the saved file went through
    allowed = allowed_changes(cfg)
    changes = {k: v for k, v in changed_fields(old, new).items() if not _safe(k)}
    refused = {k: v for k, v in changes.items() if "all" not in allowed and k not in allowed}
    if refused:
        listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(refused.items()))
        raise ConfigError(f"resuming the run in {os.path.dirname(saved_path)} with changed settings that alter the "
                          f"training: {listing}. Start a new run folder (--trainer.default_local_dir), or accept them "
                          f"with --reliability.allow_config_change {','.join(sorted(refused))}")


def write_config(cfg, run_dir: str, saved_path: str | None) -> None:
    """Check `cfg` against `saved_path` (the resumed run's config.yaml, if resuming), then write config.yaml;
    an earlier, different config.yaml is kept as config.<N>.yaml."""
    allowed_changes(cfg)  # a misspelt name fails at every start, not only at the resume that needs it
    if saved_path is not None and os.path.isfile(saved_path):
        check_resume_config(saved_path, cfg)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CONFIG_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    dump_yaml(cfg, tmp)
    if os.path.isfile(path):
        with open(path, "rb") as f, open(tmp, "rb") as g:
            same = f.read() == g.read()
        if not same:
            numbers = [int(m.group(1)) for m in map(_NUMBERED_RE.match, os.listdir(run_dir)) if m]
            os.replace(path, os.path.join(run_dir, f"config.{max(numbers, default=0) + 1}.yaml"))
    os.replace(tmp, path)
