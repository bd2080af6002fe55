"""The engine registry: `rollout.name` -> the builder of an engine, and `build_rollout`.

    engine = build_rollout(config, model_path, tokenizer, hf_config, device)  # ENGINES[config.name]

* `ENGINES`: name -> `EngineSpec`. A new engine (an HTTP server, an agent loop) is one
  `@register_engine("name")` builder; `rollout.name` picks it. The three built-in ones are here:
  "native" (native/), "vllm" (vllm/), "remote" (remote/). Each builder imports its engine lazily, so an
  engine's dependencies load only when it is picked.
* "auto" picks vLLM where it is usable (importable, a tested version, a GPU present) and the native
  engine otherwise, with a notice (`resolve_auto`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from tinyzero.rollout.engine import RolloutEngine

if TYPE_CHECKING:
    from tinyzero.rollout.config import RolloutConfig

EngineBuilder = Callable[..., RolloutEngine]


@dataclass(frozen=True)
class EngineSpec:
    """A registered engine: `build(config, model_path, hf_config, device, dp_rank, load_weights,
    trust_remote_code[, lora_rank=N when model.lora_rank > 0])` returns it; `unavailable()` gives why it
    cannot run here (None if it can)."""

    name: str
    build: EngineBuilder
    unavailable: Callable[[], str | None]


ENGINES: dict[str, EngineSpec] = {}


def register_engine(name: str, unavailable: Callable[[], str | None] = lambda: None):
    """Decorator registering an engine builder under `name` (what rollout.name selects)."""
    def wrap(build: EngineBuilder) -> EngineBuilder:
        if name in ENGINES or name == "auto":
            raise ValueError(f"rollout engine {name!r} is already registered (or reserved)")
        ENGINES[name] = EngineSpec(name, build, unavailable)
        return build
    return wrap


def engine_names() -> tuple[str, ...]:
    """Every value rollout.name accepts."""
    return ("auto", *ENGINES)


def _vllm_unavailable() -> str | None:
    from tinyzero.rollout.vllm import backend

    return backend.vllm_available() or backend.version_problem()


@register_engine("native")
def _build_native(config, model_path, hf_config, device, dp_rank, load_weights, trust_remote_code, lora_rank=0,
                  tp_group=None):
    from tinyzero.rollout.native import NativeRollout

    return NativeRollout(config, hf_config, device, model_path=model_path if load_weights else None,
                         dp_rank=dp_rank, trust_remote_code=trust_remote_code, tp_group=tp_group)


@register_engine("vllm", unavailable=_vllm_unavailable)
def _build_vllm(config, model_path, hf_config, device, dp_rank, load_weights, trust_remote_code, lora_rank=0):
    from tinyzero.rollout.vllm import VLLMRollout

    return VLLMRollout(config, model_path, hf_config, device, dp_rank=dp_rank, load_dummy=not load_weights,
                       trust_remote_code=trust_remote_code, lora_rank=lora_rank)


@register_engine("remote")
def _build_remote(config, model_path, hf_config, device, dp_rank, load_weights, trust_remote_code, lora_rank=0):
    from tinyzero.rollout.remote import RemoteRollout

    return RemoteRollout(config, dp_rank=dp_rank)


def resolve_auto(notice: Callable[[str], None] | None = print) -> str:
    """rollout.name=auto: "vllm" where vLLM is usable (importable, a tested version) and a GPU is
    present, else "native"; `notice` gets one line saying which and why (None: silent)."""
    if not torch.cuda.is_available():
        name, why = "native", "no GPU"
    else:
        reason = ENGINES["vllm"].unavailable()
        name, why = ("native", reason) if reason else ("vllm", "vLLM is installed and a GPU is present")
    if notice is not None:
        notice(f"rollout.name=auto -> {name} ({why})")
    return name


def build_rollout(config: RolloutConfig, model_path: str, tokenizer=None, hf_config=None,
                  device: torch.device | str | None = None, dp_rank: int = 0, load_weights: bool = False,
                  trust_remote_code: bool = False, lora_rank: int = 0, tp_group=None) -> RolloutEngine:
    """Build the engine named by config.name on `device` (a registry lookup).

    model_path: the HF folder (vLLM reads its config; the native engine reads weights from it only
    when load_weights is True). hf_config: the model's config (read from model_path when None).
    dp_rank: this rank's data-parallel index (rank // tensor_model_parallel_size); it decorrelates
    the samplers of different DP ranks. load_weights: start from the checkpoint's weights instead of
    waiting for update_weights. tokenizer: engines work on ids (the agent loop that
tinyzero.agent.build_agent_engine wraps around the engine renders observations with it).
    lora_rank: model.lora_rank; > 0 builds vLLM with its LoRA layers (adapter-only syncs).
    tp_group: the process group of this rank's rollout tensor-parallel group (tensor_model_parallel_size
    consecutive ranks), which the native engine splits its decode over; vLLM builds its own groups.
    """
    name = resolve_auto() if config.name == "auto" else config.name
    spec = ENGINES.get(name)
    if spec is None:
        raise ValueError(f"rollout.name={name!r} is not a registered engine; use one of {engine_names()}")
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                               local_files_only=True)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    extra = {"lora_rank": lora_rank} if lora_rank else {}  # builders that know no LoRA keep working without it
    if name == "native" and tp_group is not None:
        extra["tp_group"] = tp_group
    return spec.build(config, model_path, hf_config, device, dp_rank, load_weights, trust_remote_code, **extra)
