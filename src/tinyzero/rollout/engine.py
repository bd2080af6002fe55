"""The rollout-engine interface, its typed sampling parameters and the engine registry.

    engine = build_rollout(config, model_path, tokenizer, hf_config, device)  # ENGINES[config.name]
    engine.update_weights(named_tensors); out = engine.generate_sequences(prompts)

* `RolloutEngine`: what every engine implements (native.py, vllm_rollout.py). Every engine returns
  the same DataProto keys (outputs.py).
* `SamplingParams`: one typed object per generate call, built in one function,
  `sampling_params(config, meta_info, num_calls, dp_rank)`, from the rollout config and the batch's
  `meta_info` (veRL's keys, SAMPLING_META_KEYS: callers keep passing meta_info).
* `ENGINES`: name -> `EngineSpec`. A new engine (an HTTP server, an agent loop) is one
  `@register_engine("name")` builder; `rollout.name` picks it. "auto" picks vLLM where it is usable
  (importable, a tested version, a GPU present) and the native engine otherwise, with a notice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from tinyzero.protocol import DataProto
    from tinyzero.rollout.config import RolloutConfig


@runtime_checkable
class RolloutEngine(Protocol):
    """A rollout engine as the actor worker drives it (GPU order: wake_up(["weights"]), update_weights,
    wake_up(["kv_cache"]), generate_sequences, sleep)."""

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Left-padded prompts (input_ids, attention_mask, position_ids (B, P); meta_info with
        SAMPLING_META_KEYS) -> B*n rows: prompts, responses, input_ids, attention_mask, position_ids,
        response_mask, rollout_log_probs (outputs.py); rows of prompt i are i*n .. i*n+n-1."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> object:
        """Load (HF name, full tensor) pairs, consumed lazily, in place."""
        ...

    def sleep(self) -> None:
        """Free device memory for training (KV cache, and weights where the engine can); may be a no-op."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what sleep freed: tags among ("weights", "kv_cache"), None for both."""
        ...

    def shutdown(self) -> None:
        """Release the engine (the last call on it)."""
        ...

    def memory_metrics(self) -> dict[str, float]:
        """Device memory per phase as `rollout/mem_*` metrics (GiB); {} where nothing is tracked."""
        ...


# meta_info keys an engine reads (veRL's names); others (e.g. global_steps) pass through untouched.
SAMPLING_META_KEYS = {
    "pad_token_id": "required: the id responses are right-padded with",
    "eos_token_id": "stop id or list of ids (the worker sets the generation config's list)",
    "stop_token_ids": "more stop ids",
    "stop_sequences": "token-id sequences that also end a response, kept in it (e.g. a tool call's closing tag)",
    "validate": "True: sampling from rollout.val_kwargs instead of the rollout config",
    "n": "responses per prompt", "temperature": "sampling temperature", "top_p": "nucleus mass",
    "top_k": "top-k, -1 disables", "do_sample": "False: greedy",
    "response_length": "most new tokens (default rollout.response_length)",
    "seed": "the step's sampling seed (mixed with the data-parallel rank; default a fresh one per call)",
}


def check_sampling(prefix: str, temperature: float, top_p: float, top_k: int, n: int) -> None:
    """Raise ValueError naming `prefix + field` for a sampling setting out of range."""
    if temperature < 0:
        raise ValueError(f"{prefix}temperature={temperature} must be >= 0 (0 means greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{prefix}top_p={top_p} must be in (0, 1]; use 1.0 to disable nucleus sampling")
    if top_k < -1 or top_k == 0:
        raise ValueError(f"{prefix}top_k={top_k} must be -1 (disabled) or a positive count")
    if n < 1:
        raise ValueError(f"{prefix}n={n} must be >= 1")


@dataclass
class SamplingParams:
    """Everything one `generate_sequences` call needs to know about sampling."""

    n: int = 1
    """Responses per prompt."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are reported at it)."""
    top_p: float = 1.0
    """Nucleus mass; 1.0 disables."""
    top_k: int = -1
    """Top-k; -1 disables."""
    do_sample: bool = True
    """False: greedy."""
    response_length: int = 16
    """Most new tokens per response."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after any of these (kept in the response)."""
    stop_sequences: list[list[int]] = field(default_factory=list)
    """Generation also stops right after any of these token-id sequences, all of it sampled within the
    response (kept in the response). One-token sequences belong in stop_token_ids (resolve_sampling_params
    moves them there)."""
    pad_token_id: int = 0
    """Right padding of responses."""
    seed: int = 0
    """Seed of this call's sampler."""
    request_seeds: bool = True
    """vLLM and served engines: each request carries its seed (rollout.request_seeds); False leaves
    sampling to the engine's own generator."""

    def __post_init__(self):
        check_sampling("sampling.", self.temperature, self.top_p, self.top_k, self.n)
        if self.response_length < 1:
            raise ValueError(f"response_length={self.response_length} must be >= 1")
        bad = [seq for seq in self.stop_sequences if not seq or not all(isinstance(t, int) for t in seq)]
        if bad:
            raise ValueError(f"stop_sequences={bad[:2]}: every stop sequence must be a non-empty list of token ids")

    @property
    def greedy(self) -> bool:
        return (not self.do_sample) or self.temperature == 0.0


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def resolve_sampling_params(config: RolloutConfig, meta_info: dict, seed: int) -> SamplingParams:
    """The rollout config (or its val_kwargs when meta_info["validate"]) overridden by the batch's
    meta_info keys (SAMPLING_META_KEYS), with this call's `seed`."""
    if meta_info.get("validate", False):
        vk = config.val_kwargs
        base = dict(n=vk.n, temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k, do_sample=vk.do_sample)
    else:
        base = dict(n=config.n, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                    do_sample=config.do_sample)
    for key in ("n", "temperature", "top_p", "top_k", "do_sample"):
        if meta_info.get(key) is not None:
            base[key] = type(base[key])(meta_info[key])
    stop = _as_id_list(meta_info.get("eos_token_id")) + _as_id_list(meta_info.get("stop_token_ids"))
    sequences = []
    for seq in meta_info.get("stop_sequences") or []:
        seq = _as_id_list(seq)
        if len(seq) == 1:
            stop += seq
        elif seq not in sequences:
            sequences.append(seq)
    if "pad_token_id" not in meta_info:
        raise ValueError("prompt batch meta_info lacks pad_token_id (the dataloader sets it from the tokenizer)")
    return SamplingParams(response_length=int(meta_info.get("response_length", config.response_length)),
                          stop_token_ids=sorted(set(stop)), stop_sequences=sequences,
                          pad_token_id=int(meta_info["pad_token_id"]), seed=int(seed),
                          request_seeds=config.request_seeds is not False, **base)


def call_seed(config_seed: int, meta_info: dict, num_calls: int, dp_rank: int) -> int:
    """The sampling seed of one generate call on one data-parallel rank.

    The base is the batch's `meta_info["seed"]` when the trainer sets one (a seed per step, so
    a resumed run replays the same samples), else a fresh stream per call from the config seed.
    The DP rank is always mixed in: rows at the same position on different ranks must not share
    sampling noise. Ranks of one tensor-parallel group share a DP rank, so they stay equal.
    """
    base = int(meta_info["seed"]) if "seed" in meta_info else config_seed * 1_000_003 + num_calls * 7_919
    return (base * 1_000_003 + dp_rank * 100_003) % 2**62


def sampling_params(config: RolloutConfig, meta_info: dict, num_calls: int, dp_rank: int) -> SamplingParams:
    """The typed parameters of an engine's `num_calls`-th generate call on data-parallel rank `dp_rank`:
    the one place meta_info becomes sampling settings."""
    return resolve_sampling_params(config, meta_info, call_seed(config.seed, meta_info, num_calls, dp_rank))


# ---------------------------------------------------------------------------------------------- registry
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
    from tinyzero.rollout import vllm_backend

    return vllm_backend.vllm_available() or vllm_backend.version_problem()


@register_engine("native")
def _build_native(config, model_path, hf_config, device, dp_rank, load_weights, trust_remote_code, lora_rank=0,
                  tp_group=None):
    from tinyzero.rollout.native import NativeRollout

    return NativeRollout(config, hf_config, device, model_path=model_path if load_weights else None,
                         dp_rank=dp_rank, trust_remote_code=trust_remote_code, tp_group=tp_group)


@register_engine("vllm", unavailable=_vllm_unavailable)
def _build_vllm(config, model_path, hf_config, device, dp_rank, load_weights, trust_remote_code, lora_rank=0):
    from tinyzero.rollout.vllm_rollout import VLLMRollout

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
