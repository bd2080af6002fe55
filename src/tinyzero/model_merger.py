"""Turn a saved training checkpoint into a HF model folder, offline (veRL's `python -m verl.model_merger`).

    python -m tinyzero.model_merger merge --backend fsdp \
        --local_dir RUN/checkpoints/global_step_N/actor --target_dir OUT
    python -m tinyzero.model_merger test --backend fsdp \
        --local_dir RUN/checkpoints/global_step_N/actor --test_hf_dir REF      # or --hf_model_path REF

`--local_dir` is a role folder (`actor`, `critic`, or `model` for SFT / RM / DPO runs) or the step folder
above it (then `actor`, else `model`, is taken). A checkpoint saved on any number of ranks, with tensor
parallelism or on a pool of its own reads the same way: torch DCP reassembles every tensor from its
shards, one process on CPU, no torch.distributed.

What the model is built from comes from the run's `config.yaml` (two folders above the step folder, or
`--config`): the model folder (its config.json with the run's override_config, tokenizer and
generation_config.json) and, for LoRA, the rank, alpha and target layers. `--hf_model_path` points
at another copy of the base model folder. The folder is written by the trainer's own export
(tinyzero.models.hf_export): safetensors shards + index, config.json, generation_config.json,
tokenizer files; tied embeddings once; written to a temporary folder and renamed.

A LoRA checkpoint holds the adapters only; the frozen base comes from the model folder.
`--lora_mode both` (default) writes the merged model (W + alpha / r * B A) to target_dir and the PEFT
adapter to target_dir/lora_adapter (where veRL's merger puts it); `merged` or `adapter` writes one.

`test` builds the same tensors `merge` would write and compares them with a reference HF folder's
safetensors, tensor by tensor, in the export's order; exit 1 naming the first one that differs.

Bad input (a missing path, a folder that is not a checkpoint, a checkpoint whose save was interrupted
or is still running, a file whose checksum does not match the manifest) exits 2 with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn

ROLE_KINDS = {"actor": "causal_lm", "critic": "value", "model": "causal_lm"}
ROLE_ORDER = ("actor", "model", "critic")  # what a step folder resolves to, first present wins
LORA_MODES = ("both", "merged", "adapter")
DTYPES = {"checkpoint": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ADAPTER_SUBDIR = "lora_adapter"


class MergerError(ValueError):
    """Input the merger cannot use; the message names what to pass instead."""


@dataclass(frozen=True)
class Checkpoint:
    """One role's checkpoint, found and verified."""

    step_dir: str
    role_dir: str
    role: str


@dataclass(frozen=True)
class ModelSource:
    """What to build the role's model from."""

    model_config: object  # tinyzero.models.config.ModelConfig
    kind: str  # "causal_lm" | "value" | "reward"


# --------------------------------------------------------------------------- finding the checkpoint


def _has_dcp(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, ".metadata"))


def _step_number(name: str) -> int | None:
    from tinyzero.trainer.checkpoint import step_of

    try:
        return step_of(name)
    except ValueError:
        return None


def find_checkpoint(local_dir: str, checksum: bool = True) -> Checkpoint:
    """The role folder `local_dir` names (a role folder or its step folder), verified against its manifest."""
    from tinyzero.trainer.checkpoint import MARKER, verify_checkpoint

    path = os.path.abspath(local_dir)
    if not os.path.exists(path):
        raise MergerError(f"--local_dir {local_dir}: no such folder")
    if not os.path.isdir(path):
        raise MergerError(f"--local_dir {local_dir}: is a file; pass a checkpoint folder "
                          "(RUN/checkpoints/global_step_N/actor)")
    if _has_dcp(path):
        step_dir, role = os.path.dirname(path), os.path.basename(path)
    else:
        step_dir = path
        role = next((r for r in ROLE_ORDER if _has_dcp(os.path.join(path, r))), None)
    step_name = os.path.basename(step_dir)
    if ".tmp-" in step_name:
        raise MergerError(f"--local_dir {local_dir}: {step_name} is the temporary folder of a save that is still "
                          "running or was interrupted; pass a finished global_step_N folder")
    if role is None:
        steps = sorted((_step_number(n), n) for n in os.listdir(path) if _step_number(n) is not None)
        if steps:
            raise MergerError(f"--local_dir {local_dir}: is a folder of checkpoints; pass one step's role folder, "
                              f"e.g. {os.path.join(local_dir, steps[-1][1], 'actor')}")
        raise MergerError(f"--local_dir {local_dir}: not a tinyzero checkpoint (no DCP .metadata here or in "
                          f"{'/'.join(ROLE_ORDER)}/); pass RUN/checkpoints/global_step_N/actor")
    if _step_number(step_name) is None:
        raise MergerError(f"--local_dir {local_dir}: the role folder must sit in its global_step_N folder (its "
                          f"{MARKER} manifest is how a finished save is told from an interrupted one)")
    if not os.path.isfile(os.path.join(step_dir, MARKER)):
        raise MergerError(f"--local_dir {local_dir}: {step_dir} has no {MARKER}: the save is still running or was "
                          "interrupted; wait for it, or pass an earlier global_step_N")
    reason = verify_checkpoint(step_dir, checksum=checksum)
    if reason is not None:
        raise MergerError(f"--local_dir {local_dir}: corrupt checkpoint ({reason}); take an earlier global_step_N "
                          "or a fresh copy")
    return Checkpoint(step_dir, os.path.join(step_dir, role), role)


def run_config_path(ckpt: Checkpoint, config: str | None) -> str | None:
    """`--config`, else RUN/config.yaml of the run that wrote the checkpoint (None when absent)."""
    from tinyzero.trainer.run_config import CONFIG_FILE

    if config is not None:
        if not os.path.isfile(config):
            raise MergerError(f"--config {config}: no such file; pass the run's config.yaml")
        return config
    path = os.path.join(os.path.dirname(os.path.dirname(ckpt.step_dir)), CONFIG_FILE)
    return path if os.path.isfile(path) else None


def model_source(ckpt: Checkpoint, config_path: str | None, hf_model_path: str | None,
                 trust_remote_code: bool) -> ModelSource:
    """The role's ModelConfig (from the run's config, `--hf_model_path` replacing its folder) and model kind."""
    from tinyzero.config import ConfigError
    from tinyzero.config.parse import load_yaml
    from tinyzero.models.config import ModelConfig

    kind = ROLE_KINDS.get(ckpt.role, "causal_lm")
    if config_path is None:
        if hf_model_path is None:
            raise MergerError(f"no config.yaml found for {ckpt.step_dir} (looked two folders up); pass "
                              "--hf_model_path BASE_MODEL_FOLDER, or --config RUN/config.yaml")
        model_config = ModelConfig(path=hf_model_path)
    else:
        try:
            with warnings.catch_warnings():  # notes about training keys: only the model section is read here
                warnings.simplefilter("ignore")
                cfg = load_yaml(config_path)
        except (ConfigError, ValueError) as e:
            raise MergerError(f"cannot read the run's config: {e}") from None
        model_config = cfg.actor_rollout_ref.model
        if ckpt.role == "critic":  # an empty critic.model.path means the actor's folder, as in training
            model_config = replace(cfg.critic.model, path=cfg.critic.model.path or model_config.path)
        if ckpt.role == "model" and cfg.trainer.mode == "rm":
            kind = "reward"
        if hf_model_path is not None:
            model_config = replace(model_config, path=hf_model_path)
    if not model_config.path:
        raise MergerError(f"{config_path} names no model folder; pass --hf_model_path BASE_MODEL_FOLDER")
    if not os.path.isdir(model_config.path):
        raise MergerError(f"model folder {model_config.path} (the run's model.path) does not exist; pass "
                          "--hf_model_path with a copy of the base model")
    if trust_remote_code:
        model_config = replace(model_config, trust_remote_code=True)
    return ModelSource(model_config, kind)


# --------------------------------------------------------------------------- building the model


def checkpoint_model_tensors(role_dir: str) -> dict[str, object]:
    """{parameter name: DCP tensor metadata} of the model entries of a role folder."""
    from tinyzero.models.safe_dcp import SafeFileSystemReader, UnsafeCheckpointError

    try:
        meta = SafeFileSystemReader(role_dir).read_metadata()
    except UnsafeCheckpointError as e:
        raise MergerError(str(e)) from None
    out = {k[len("model."):]: v for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    if not out:
        raise MergerError(f"{role_dir}: the checkpoint holds no model tensors")
    return out


def _build(source: ModelSource, device: str, dtype: torch.dtype | str) -> nn.Module:
    from tinyzero.models.loading import load_model
    from tinyzero.models.value import load_reward_model, load_value_model

    mc = source.model_config
    kwargs = dict(dtype=dtype, device=device, attn_implementation="sdpa", trust_remote_code=mc.trust_remote_code,
                  override_config=mc.override_config)
    builder = {"value": load_value_model, "reward": load_reward_model}.get(source.kind)
    return builder(mc.path, **kwargs) if builder else load_model(mc.path, "causal_lm", **kwargs)


def load_checkpoint_model(ckpt: Checkpoint, source: ModelSource) -> nn.Module:
    """The role's model on CPU holding the checkpoint's weights (LoRA: base weights + the saved adapters)."""
    from tinyzero.models.lora import LoraSpec, apply_lora, is_lora_name

    saved = checkpoint_model_tensors(ckpt.role_dir)
    floats = [m.properties.dtype for m in saved.values() if getattr(m, "properties", None) is not None
              and m.properties.dtype.is_floating_point]
    dtype = floats[0] if floats else torch.float32
    adapters = sorted(n for n in saved if is_lora_name(n))
    with torch.device("cpu"):
        if not adapters:
            # Every persistent tensor is in the checkpoint: build the architecture only, then fill it.
            model = _build(source, "meta", dtype)
            model.to_empty(device="cpu")
            if hasattr(model, "tie_weights"):  # to_empty gives tied parameters separate storage
                model.tie_weights()
            _load_quietly(ckpt.role_dir, model)
            return model
        spec = LoraSpec.from_model_config(source.model_config)
        if spec is None:
            raise MergerError(f"{ckpt.role_dir} holds LoRA adapters but the run's config has model.lora_rank=0; "
                              "pass --config with the config of the run that trained them")
        # The frozen base is not in the checkpoint: read it in the run's model.dtype, as training did, beside
        # the adapters in the dtype they were saved in.
        model = _build(source, "cpu", source.model_config.dtype)
        apply_lora(model, spec, dtype=dtype, init=False)
        expected = sorted(n for n, _ in model.named_parameters() if is_lora_name(n))
        if expected != adapters:
            missing, extra = sorted(set(expected) - set(adapters)), sorted(set(adapters) - set(expected))
            raise MergerError(f"{ckpt.role_dir}: its adapters do not match model.target_modules="
                              f"{source.model_config.target_modules!r} (missing {missing[:2]}, unexpected {extra[:2]})")
        _load_quietly(ckpt.role_dir, model, trainable_only=True)
        return model


def _load_quietly(role_dir: str, model: nn.Module, trainable_only: bool = False) -> None:
    from tinyzero.models.role_state import load_state

    with warnings.catch_warnings():  # DCP notes that it reads in one process, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_state(role_dir, model, trainable_only=trainable_only)


# --------------------------------------------------------------------------- merge and test


def merge(ckpt: Checkpoint, source: ModelSource, target_dir: str, lora_mode: str = "both",
          dtype: torch.dtype | None = None) -> list[str]:
    """Write the role's model as a HF folder at target_dir (LoRA: see lora_mode); returns the folders written."""
    from tinyzero.models.hf_export import export_hf
    from tinyzero.models.loading import load_tokenizer
    from tinyzero.models.lora import LoraSpec, has_lora, merged_in_place, save_adapter

    target = os.path.abspath(target_dir)
    if target == ckpt.step_dir or target.startswith(ckpt.step_dir + os.sep):
        raise MergerError(f"--target_dir {target_dir} is inside the checkpoint {ckpt.step_dir}; pick a folder outside "
                          "it (a file added there breaks the checkpoint's manifest)")
    if os.path.isdir(target) and os.listdir(target) and not any(
            os.path.exists(os.path.join(target, n)) for n in ("config.json", ADAPTER_SUBDIR)):
        raise MergerError(f"--target_dir {target_dir} exists and is not a model folder; pick a new or empty folder")
    model = load_checkpoint_model(ckpt, source)
    mc = source.model_config
    tokenizer = load_tokenizer(mc.resolved_tokenizer_path, mc.trust_remote_code)
    if not has_lora(model):
        if lora_mode == "adapter":
            raise MergerError(f"--lora_mode adapter: {ckpt.role_dir} holds full weights, no LoRA adapters; drop the "
                              "flag to write the model")
        return [export_hf(model, target, tokenizer=tokenizer, dtype=dtype)]
    written = []
    if lora_mode in ("both", "merged"):
        with merged_in_place(model):
            written.append(export_hf(model, target, tokenizer=tokenizer, dtype=dtype))
    if lora_mode in ("both", "adapter"):
        adapter_dir = save_adapter(model, os.path.join(target, ADAPTER_SUBDIR), LoraSpec.from_model_config(mc),
                                   os.path.abspath(mc.path))
        tokenizer.save_pretrained(adapter_dir)
        written.append(adapter_dir)
    return written


def exported_tensors(model: nn.Module):
    """(name, tensor) as `merge` writes them: LoRA merged, tied weights once."""
    from tinyzero.models.hf_export import iter_export_tensors
    from tinyzero.models.lora import has_lora, merged_in_place

    with merged_in_place(model) if has_lora(model) else contextlib.nullcontext():
        yield from iter_export_tensors(model)


def reference_tensors(ref_dir: str) -> dict[str, tuple[str, str]]:
    """{tensor name: (safetensors file, name)} of a HF folder."""
    from safetensors import safe_open

    if not os.path.isdir(ref_dir):
        raise MergerError(f"reference folder {ref_dir}: no such folder")
    files = sorted(f for f in os.listdir(ref_dir) if f.endswith(".safetensors"))
    if not files:
        raise MergerError(f"reference folder {ref_dir} has no .safetensors files; pass a HF model folder "
                          "(save_pretrained with safe_serialization)")
    out = {}
    for name in files:
        try:
            with safe_open(os.path.join(ref_dir, name), framework="pt") as f:
                out.update({k: (os.path.join(ref_dir, name), k) for k in f.keys()})
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
            raise MergerError(f"reference file {os.path.join(ref_dir, name)} is unreadable ({e})") from None
    return out


def compare(model: nn.Module, ref_dir: str, atol: float = 0.0, rtol: float = 0.0) -> tuple[int, str | None]:
    """(tensors compared, None) when the model's export equals ref_dir's tensors, else (count, what differs)."""
    from safetensors import safe_open

    ref = reference_tensors(ref_dir)
    seen = set()
    for name, ours in exported_tensors(model):
        seen.add(name)
        if name not in ref:
            return len(seen), f"tensor {name!r}: in the checkpoint, not in the reference"
        path, key = ref[name]
        with safe_open(path, framework="pt") as f:
            theirs = f.get_tensor(key)
        if ours.shape != theirs.shape:
            return len(seen), f"tensor {name!r}: shape {tuple(ours.shape)} vs the reference's {tuple(theirs.shape)}"
        ours = ours.to(theirs.dtype)
        if not torch.allclose(ours, theirs, atol=atol, rtol=rtol, equal_nan=True):
            diff = (ours.double() - theirs.double()).abs().max().item()
            return len(seen), f"tensor {name!r} differs: max |diff| {diff:.3g} (atol {atol:g}, rtol {rtol:g})"
    extra = sorted(set(ref) - seen)
    if extra:
        return len(seen), f"tensor {extra[0]!r}: in the reference, not in the checkpoint ({len(extra)} such)"
    return len(seen), None


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tinyzero.model_merger",
                                     description="Checkpoint -> HF model folder (veRL's model_merger)")
    sub = parser.add_subparsers(dest="operation", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", default="fsdp", choices=["fsdp", "megatron"],
                        help="fsdp: tinyzero's checkpoints (torch DCP shards); megatron is refused")
    common.add_argument("--local_dir", required=True,
                        help="RUN/checkpoints/global_step_N/actor (or critic, model), or the step folder")
    common.add_argument("--config", default=None, help="the run's config.yaml, when it is not two folders above "
                        "the step folder")
    common.add_argument("--trust-remote-code", "--trust_remote_code", dest="trust_remote_code",
                        action="store_true", help="run the model folder's own code (off unless asked)")
    common.add_argument("--is-value-model", "--is_value_model", dest="is_value_model", action="store_true",
                        help="veRL's flag; a critic folder is a value model already, any other is refused")
    common.add_argument("--tie-word-embedding", "--tie_word_embedding", dest="tie_word_embedding",
                        action="store_true", help="accepted (Megatron-only in veRL); config.json decides tying")
    common.add_argument("--use_cpu_initialization", action="store_true",
                        help="accepted; the model is always built on CPU")
    common.add_argument("--no_checksum", action="store_true",
                        help="check file sizes against the manifest but skip the sha256 of each file")
    merge_p = sub.add_parser("merge", parents=[common], help="write a HF model folder")
    merge_p.add_argument("--target_dir", default="tmp", help="folder to write (replaced if it holds a model)")
    merge_p.add_argument("--hf_model_path", default=None,
                         help="base model folder (config, tokenizer; LoRA: base weights) instead of the run's "
                              "model.path")
    merge_p.add_argument("--lora_mode", default="both", choices=LORA_MODES,
                         help=f"LoRA: merged model in target_dir and/or the PEFT adapter in target_dir/"
                              f"{ADAPTER_SUBDIR}")
    merge_p.add_argument("--dtype", default="checkpoint", choices=list(DTYPES),
                         help="dtype of the floating-point tensors written (checkpoint: as saved)")
    merge_p.add_argument("--hf_upload_path", default=None, help="refused: upload target_dir with huggingface-cli")
    merge_p.add_argument("--private", action="store_true", help="accepted with --hf_upload_path")
    test_p = sub.add_parser("test", parents=[common], help="compare a checkpoint with a reference HF folder")
    test_p.add_argument("--test_hf_dir", "--hf_model_path", dest="test_hf_dir", required=True,
                        help="reference HF model folder (safetensors)")
    test_p.add_argument("--base_model_path", default=None,
                        help="base model folder instead of the run's model.path")
    test_p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (0: equal after casting "
                        "to the reference's dtype)")
    test_p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance")
    return parser


def _notes(args: argparse.Namespace) -> None:
    if args.backend == "megatron":
        raise MergerError("--backend megatron: tinyzero saves FSDP checkpoints (torch DCP shards); use --backend fsdp")
    if getattr(args, "hf_upload_path", None):
        raise MergerError("--hf_upload_path: nothing is uploaded from here; merge, then run "
                          f"`huggingface-cli upload {args.hf_upload_path} {args.target_dir}`")
    if args.use_cpu_initialization:
        print("[model_merger] note: --use_cpu_initialization is what the merger always does", file=sys.stderr)
    if args.tie_word_embedding:
        print("[model_merger] note: --tie-word-embedding ignored: the model's config.json says whether the "
              "embeddings are tied", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; 0 done, 1 `test` found a difference, 2 bad input (one line on stderr)."""
    args = _parser().parse_args(argv)
    try:
        _notes(args)
        ckpt = find_checkpoint(args.local_dir, checksum=not args.no_checksum)
        base = args.hf_model_path if args.operation == "merge" else args.base_model_path
        source = model_source(ckpt, run_config_path(ckpt, args.config), base, args.trust_remote_code)
        if args.is_value_model and source.kind != "value":
            raise MergerError(f"--is-value-model: {ckpt.role_dir} is a {source.kind} model (a critic's folder is "
                              "the value model); drop the flag or pass RUN/checkpoints/global_step_N/critic")
        if args.operation == "merge":
            for folder in merge(ckpt, source, args.target_dir, args.lora_mode, DTYPES[args.dtype]):
                print(f"[model_merger] wrote {folder}")
            return 0
        count, problem = compare(load_checkpoint_model(ckpt, source), args.test_hf_dir, args.atol, args.rtol)
    except ValueError as e:  # MergerError, and the loaders' errors naming the file to fix
        print(f"model_merger: error: {e}", file=sys.stderr)
        return 2
    if problem is not None:
        print(f"model_merger: test failed: {problem}", file=sys.stderr)
        return 1
    print(f"[model_merger] test passed: {count} tensors of {ckpt.role_dir} equal those of {args.test_hf_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
