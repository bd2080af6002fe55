"""LoRA adapters for the actor: wrap linear layers, disable them for the reference, merge, PEFT files.

    spec = LoraSpec(rank=8, alpha=16, target_modules="all-linear")
    apply_lora(model, spec)                    # before fully_shard: adapters shard with their layers
    with disable_adapters(model): ...          # the base policy (the reference), no second copy
    save_adapter(model, out_dir, spec)         # adapter_config.json + adapter_model.safetensors (PEFT)
    load_adapter(hf_model, out_dir)            # our loader; peft's PeftModel.from_pretrained reads the same

An adapted layer is a `LoraLinear`: the nn.Linear it replaces keeps its parameters under the
same names (`q_proj.weight`, frozen) and gains `q_proj.lora_A.weight` (rank, in; kaiming-uniform
as PEFT) and `q_proj.lora_B.weight` (out, rank; zeros), so y = W x + b + (alpha / rank) B A x.
Base names are unchanged, so loading, weight sync of the base, and HF export see the HF names;
the adapter names are PEFT's once `base_model.model.` is put in front.

Why a module of our own and not peft: the adapters are applied from outside the model before
FSDP2 (like `parallelize`), must shard with their decoder layer, stay fp32 beside a bf16 base,
and be switched off for the reference pass; that is ~50 lines here, while peft would wrap the
model in a PeftModel (renaming every parameter, which the sharded loader, the weight sync and the
DCP checkpoints key on) and add a dependency. The files are PEFT's format all the same.

`merge_adapters` turns a stream of (name, tensor) pairs with adapter pairs into merged weights
W_base + scaling * B @ A, for an engine that keeps its base weights (`AdapterMerger`) or for a
stream that carries the base weights itself (engines without adapter support get merged layers).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
LORA_PARTS = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class LoraSpec:
    """Rank, scale numerator and target layers of the adapters (veRL: model.lora_rank / lora_alpha /
    target_modules)."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...] = "all-linear"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_model_config(cls, model_config) -> LoraSpec | None:
        """The spec of a ModelConfig, or None when LoRA is off (lora_rank=0)."""
        if not model_config.lora_rank:
            return None
        targets = model_config.target_modules
        targets = targets if isinstance(targets, str) else tuple(targets)
        return cls(int(model_config.lora_rank), float(model_config.lora_alpha), targets)


class LoraLinear(nn.Linear):
    """nn.Linear (frozen, same parameter names) plus a low-rank update scaled by alpha / rank."""

    scaling: float
    lora_enabled: bool

    @classmethod
    def from_linear(cls, base: nn.Linear, spec: LoraSpec, dtype: torch.dtype, init: bool) -> LoraLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = base.in_features, base.out_features
        new.weight = base.weight
        new.bias = base.bias
        new.scaling, new.lora_enabled = spec.scaling, True
        device = base.weight.device
        new.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, device=device, dtype=dtype)
        new.lora_B = nn.Linear(spec.rank, base.out_features, bias=False, device=device, dtype=dtype)
        if init:
            new.reset_lora_parameters()
        return new

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """PEFT's default init: A kaiming-uniform (as nn.Linear), B zeros, so the update starts at 0."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return y
        a = self.lora_A.weight
        return y + (self.lora_B(self.lora_A(x.to(a.dtype))) * self.scaling).to(y.dtype)


def target_layer_names(model: nn.Module, target_modules: str | tuple[str, ...]) -> list[str]:
    """Module names of the nn.Linear layers `target_modules` selects ("all-linear": all but the output
    head, as PEFT; else names matched exactly or as the last dotted parts, e.g. "q_proj")."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]
    if target_modules == "all-linear":
        names = [n for n, _ in linear]
    else:
        keys = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
        names = [n for n, _ in linear if any(n == k or n.endswith("." + k) for k in keys)]
    if not names:
        examples = sorted({n.rsplit(".", 1)[-1] for n, _ in linear})[:12]
        raise ValueError(f"model.target_modules={target_modules!r} matches no linear layer of "
                         f"{type(model).__name__}; its linear layers are named {examples} (or use 'all-linear')")
    return names


def apply_lora(model: nn.Module, spec: LoraSpec, dtype: torch.dtype = torch.float32, init: bool = True) -> list[str]:
    """Replace the target layers by LoraLinear in place and freeze everything but the adapters.

    `dtype` is the adapters' (fp32 whatever the base is); `init=False` leaves them uninitialized (meta
    models, or adapters about to be loaded). Returns the adapted module names."""
    if spec.rank < 1:
        raise ValueError(f"model.lora_rank={spec.rank} must be >= 1 to apply LoRA")
    names = target_layer_names(model, spec.target_modules)
    model.requires_grad_(False)
    for name in names:
        replace_with_lora(model, name, spec, dtype, init)
    return names


def replace_with_lora(model: nn.Module, name: str, spec: LoraSpec, dtype: torch.dtype = torch.float32,
                      init: bool = True) -> LoraLinear:
    """Swap the nn.Linear at `name` for a LoraLinear over the same base weight; returns the new layer."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    layer = LoraLinear.from_linear(getattr(parent, child), spec, dtype, init)
    setattr(parent, child, layer)
    return layer


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """The model's LoraLinear layers by HF module name (wrapper prefixes stripped)."""
    from tinyzero.distributed.full_params import clean_param_name

    return {clean_param_name(n): m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLinear) for m in model.modules())


def is_lora_name(name: str) -> bool:
    """Whether a parameter name is an adapter weight (`<layer>.lora_A.weight` / `.lora_B.weight`)."""
    return name.endswith(LORA_PARTS)


@contextlib.contextmanager
def disable_adapters(model: nn.Module):
    """The base model inside (every adapter off), the adapters as they were after."""
    layers = list(lora_layers(model).values())
    states = [layer.lora_enabled for layer in layers]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield model
    finally:
        for layer, state in zip(layers, states):
            layer.lora_enabled = state


def adapter_nbytes(model: nn.Module) -> int:
    """Bytes of the (full, unsharded) adapter weights: what an adapter sync or checkpoint moves."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if is_lora_name(n))


# --------------------------------------------------------------------------- merging a weight stream


def merge_adapters(stream, scaling: float, targets: set[str] = frozenset(),
                   base_of: Callable[[str], torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in, with each adapted layer's weight W out as W + scaling * B @ A.

    A layer named in `targets` takes W from the stream (held until its A and B arrive); otherwise
    `base_of(weight_name)` supplies it (an engine's kept base copy). Other pairs pass through.
    Computed in fp32 (fp64 for an fp64 W), returned in W's dtype."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        if is_lora_name(name):
            layer, part = name[:-len(".lora_A.weight")], name[-len("A.weight")]
        elif name.endswith(".weight") and name[:-len(".weight")] in targets:
            layer, part = name[:-len(".weight")], "W"
        else:
            yield name, tensor
            continue
        parts = pending.setdefault(layer, {})
        parts[part] = tensor
        if "A" in parts and "B" in parts and ("W" in parts or layer not in targets):
            del pending[layer]
            base = parts["W"] if "W" in parts else base_of(layer + ".weight")
            dtype = torch.promote_types(base.dtype, torch.float32)
            delta = parts["B"].to(dtype) @ parts["A"].to(dtype)
            yield layer + ".weight", (base.to(delta.device, dtype) + scaling * delta).to(base.dtype)
    if pending:
        raise ValueError(f"the weight stream ended with incomplete adapter pairs for {sorted(pending)[:4]}")


class AdapterMerger:
    """An engine's merge state: its base weights of the adapted layers, kept once (copied at the first
    merge, while the engine still holds the base), so every sync sets W = W_base + scaling * B @ A."""

    def __init__(self, model: nn.Module):
        self._params = dict(model.named_parameters())
        self._base: dict[str, torch.Tensor] = {}

    def _base_of(self, name: str) -> torch.Tensor:
        if name not in self._base:
            if name not in self._params:
                raise ValueError(f"adapter for {name!r}, which is not a weight of the engine's model")
            self._base[name] = self._params[name].detach().clone()
        return self._base[name]

    def merged(self, stream, scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
        return merge_adapters(stream, scaling, base_of=self._base_of)


@contextlib.contextmanager
@torch.no_grad()
def merged_in_place(model: nn.Module):
    """Inside: every adapted layer's weight holds W + scaling * B @ A and the adapters are detached
    from the module tree (state_dict / HF export see a plain HF model). After: the exact base weights
    (restored from a copy of this rank's shards) and the adapters back. Collective under FSDP2."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    saved = []
    for layer in lora_layers(model).values():
        w = layer.weight
        a, b = (p.full_tensor() if isinstance(p, DTensor) else p for p in (layer.lora_A.weight, layer.lora_B.weight))
        delta = (layer.scaling * (b.float() @ a.float()))
        local = w.to_local() if isinstance(w, DTensor) else w
        if isinstance(w, DTensor):
            delta = distribute_tensor(delta.to(local.device), w.device_mesh, w.placements, src_data_rank=None)
            delta = delta.to_local()
        saved.append((layer, local.detach().clone(), layer._modules.pop("lora_A"), layer._modules.pop("lora_B")))
        local.add_(delta.to(local.device, local.dtype))
    try:
        yield model
    finally:
        for layer, base, lora_a, lora_b in saved:
            local = layer.weight.to_local() if isinstance(layer.weight, DTensor) else layer.weight
            local.copy_(base)
            layer.lora_A, layer.lora_B = lora_a, lora_b


# --------------------------------------------------------------------------- PEFT files


def adapter_config(spec: LoraSpec, layer_names: list[str], base_model_path: str = "") -> dict:
    """PEFT's adapter_config.json for these adapters (target_modules as the layers' last names)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank,
        "lora_alpha": int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in layer_names}), "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
        "base_model_name_or_path": base_model_path,
    }


def save_adapter(model: nn.Module, out_dir: str, spec: LoraSpec, base_model_path: str = "",
                 process_group=None) -> str:
    """Write the adapters as a PEFT folder (called by every rank of the model's group; the first writes).

    Written under `<out_dir>.tmp-XXXX` and renamed, so a crash leaves no half-written adapter."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from tinyzero.distributed.full_params import iter_full_params

    writer = not dist.is_initialized() or dist.get_rank(process_group) == 0
    tensors = {}
    for name, t in iter_full_params(model, include=is_lora_name):  # collective: every rank iterates
        if writer:
            tensors[PEFT_PREFIX + name] = t.detach().to("cpu", torch.float32, copy=True).contiguous()
    if writer:
        out_dir = os.path.abspath(out_dir)
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=os.path.dirname(out_dir))
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(adapter_config(spec, list(lora_layers(model)), base_model_path), f, indent=2)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    if dist.is_initialized():
        dist.barrier(group=process_group)
    return out_dir


def read_adapter_config(adapter_dir: str) -> LoraSpec:
    """The LoraSpec of a PEFT adapter folder; a clear error for what this loader does not support."""
    path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"{adapter_dir!r} has no {ADAPTER_CONFIG}; pass a PEFT LoRA adapter folder")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("fan_in_fan_out"):
        raise ValueError(f"{path}: only plain LoRA adapters (peft_type LORA, no DoRA / rsLoRA / fan_in_fan_out) "
                         "are supported")
    targets = cfg["target_modules"]
    return LoraSpec(int(cfg["r"]), float(cfg["lora_alpha"]), targets if isinstance(targets, str) else tuple(targets))


@torch.no_grad()
def load_adapter(model: nn.Module, adapter_dir: str) -> nn.Module:
    """Apply a PEFT LoRA adapter folder to a plain (unsharded) HF model in place; returns the model."""
    from safetensors.torch import load_file

    spec = read_adapter_config(adapter_dir)
    apply_lora(model, spec, init=False)
    state = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    params = {n: p for n, p in model.named_parameters() if is_lora_name(n)}
    loaded = {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: v for k, v in state.items()}
    if loaded.keys() != params.keys():
        missing, extra = sorted(params.keys() - loaded.keys()), sorted(loaded.keys() - params.keys())
        raise ValueError(f"{adapter_dir}: adapter weights do not match the model's adapted layers "
                         f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for name, p in params.items():
        p.copy_(loaded[name])
    return model


# --------------------------------------------------------------------------- weight sync


def layer_scaling(model: nn.Module) -> float:
    """The one scaling every adapted layer of the model shares."""
    scalings = {layer.scaling for layer in lora_layers(model).values()}
    if len(scalings) != 1:
        raise ValueError(f"expected one LoRA scaling across the model's layers, found {sorted(scalings)}")
    return scalings.pop()


def model_adapter_config(model: nn.Module, base_model_path: str = "") -> dict:
    """PEFT's adapter_config of a LoRA model, read from its layers (rank, scaling, targets)."""
    layers = lora_layers(model)
    rank = int(next(iter(layers.values())).lora_A.weight.shape[0])
    alpha = layer_scaling(model) * rank
    alpha = float(round(alpha)) if abs(alpha - round(alpha)) < 1e-9 else alpha  # 16 / 3 * 3 -> 16, not 16.000000000000004
    spec = LoraSpec(rank, alpha, tuple(sorted({n.rsplit(".", 1)[-1] for n in layers})))
    return adapter_config(spec, list(layers), base_model_path)


def sync_adapters(model: nn.Module, engine, bucket_bytes: int, with_base: bool) -> int:
    """Push a LoRA policy into a rollout engine; collective over the model's mesh. Returns the count.

    The base weights go when `with_base` (the first sync, or after the engine dropped its weights), then
    the adapters only: an engine that `serves_adapters` (vLLM built with lora_rank) registers them as a
    new adapter version in memory (`update_adapter`); one with `update_lora(stream, scaling)` (the native
    one) merges them into its own copy. Other engines get every weight, the adapted layers merged
    trainer-side (a partial in-place reload in vLLM 0.32 re-initializes the layers it leaves out)."""
    from tinyzero.distributed.full_params import iter_full_params

    scaling = layer_scaling(model)
    serves = getattr(engine, "serves_adapters", False)
    if serves or hasattr(engine, "update_lora"):
        if with_base:
            engine.update_weights(iter_full_params(model, bucket_bytes, include=lambda n: not is_lora_name(n)))
        adapters = iter_full_params(model, bucket_bytes, include=is_lora_name)
        if serves:
            return engine.update_adapter(adapters, model_adapter_config(model))
        return engine.update_lora(adapters, scaling)
    stream = iter_full_params(model, bucket_bytes)
    return engine.update_weights(merge_adapters(stream, scaling, set(lora_layers(model))))
