"""The rollout-engine interface and its typed sampling parameters (the registry is registry.py).

    engine = build_rollout(config, model_path, tokenizer, hf_config, device)  # registry.py
    engine.update_weights(named_tensors); out = engine.generate_sequences(prompts)

* `RolloutEngine`: what every engine implements (native/, vllm/, remote/). Every engine returns
  the same DataProto keys (outputs.py).
* `SamplingParams`: one typed object per generate call, built in one function,
  `sampling_params(config, meta_info, num_calls, dp_rank)`, from the rollout config and the batch's
  `meta_info` (veRL's keys, SAMPLING_META_KEYS: callers keep passing meta_info).

The engines import this module and registry.py imports the engines (lazily), so this module imports
neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Protocol, runtime_checkable

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
