"""Rollout configuration (field names follow veRL's `actor_rollout_ref.rollout`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal, get_args

from tinyzero.rollout.engine import check_sampling
from tinyzero.rollout.multi_turn import MultiTurnConfig
from tinyzero.rollout.registry import engine_names

RolloutDtype = Literal["auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16"]
NativeImpl = Literal["auto", "fused", "hf"]
PrefixSharing = Literal["auto", "shared", "copy", "off"]
DTYPE_NAMES = get_args(RolloutDtype)
NATIVE_IMPLS = get_args(NativeImpl)
PREFIX_SHARING = get_args(PrefixSharing)


@dataclass
class ValKwargs:
    """Sampling used for validation (veRL: `rollout.val_kwargs`)."""

    n: int = 1
    """Responses per validation prompt."""
    temperature: float = 0.0
    """Validation sampling temperature (ignored when do_sample is False)."""
    top_p: float = 1.0
    """Validation nucleus-sampling mass."""
    top_k: int = -1
    """Validation top-k; -1 disables."""
    do_sample: bool = False
    """False: greedy validation (the default, as in veRL)."""

    def __post_init__(self):
        check_sampling("rollout.val_kwargs.", self.temperature, self.top_p, self.top_k, self.n)


@dataclass
class RolloutConfig:
    """How responses are generated during RL (veRL: `actor_rollout_ref.rollout`)."""

    name: str = "native"
    """Engine: "native" (torch only, CPU and GPU), "vllm" (in-process vLLM), any other registered engine
    (rollout/registry.py), or "auto": vLLM where it imports (a tested version) and a GPU is present, else
    native (native under trainer.device=cpu); resolved once at start-up by the run plan (tinyzero.plan),
    with a one-line notice."""
    n: int = 1
    """Responses sampled per prompt (GRPO / RLOO group size)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are reported for log_softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    prompt_length: int = 512
    """Longest prompt in tokens (the dataloader left-pads to data.max_prompt_length)."""
    response_length: int = 512
    """Maximum new tokens per response; responses are right-padded to this length."""
    do_sample: bool = True
    """False: greedy decoding for training rollouts too (validation uses val_kwargs)."""
    seed: int = 0
    """Base seed of the sampler; the same prompts, seed and weights give the same responses."""
    request_seeds: bool | None = None
    """vLLM (in-process or served): each request carries its own seed, so a row's samples do not depend on
    the rest of the batch or the engine's scheduling, and a resumed run draws the interrupted one's
    samples again. Its cost: vLLM 0.32 draws the sampling noise of seeded rows one row at a time, and on
    GPU its FlashInfer sampler does not take per-row generators. False: one draw for the whole batch from
    the engine's generator (seeded once from `seed`, veRL's behaviour). Unset: the run plan chooses, on
    on CPU (where the row loop is a small part of a step), off on GPU hosts."""
    dtype: RolloutDtype = "auto"
    """Dtype of the engine's weights: "auto" is bf16 on GPU and fp32 on CPU."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of device memory the engine may use (weights + KV cache) on GPU."""
    cpu_kv_cache_mb: int = 0
    """vLLM on CPU: KV-cache size in MiB per rank; 0 sizes it for max_num_seqs full-length sequences,
    at most 1 GiB (vLLM preempts and recomputes sequences when it runs out)."""
    tensor_model_parallel_size: int | None = None
    """Ranks per tensor-parallel group (consecutive ranks); data-parallel across groups. vLLM splits
    every layer over the group; the native engine (fused decoder) splits the MLPs and lm_head and
    gives each rank a share of the rows to attend for (rollout/native/decoder_tp.py). None: the run plan
    decides (the native engine on CPU decodes over every rank of a one-host policy pool when the
    model's MLP splits evenly; else 1; tinyzero.plan)."""
    enforce_eager: bool = True
    """vLLM: run eagerly (no CUDA graphs / torch.compile)."""
    max_num_batched_tokens: int = 8192
    """vLLM: tokens per scheduler step (chunked prefill budget)."""
    max_num_seqs: int = 256
    """vLLM: most sequences in flight at once; native: largest batch decoded at once."""
    free_cache_engine: bool = True
    """Sleep after generation to free the KV cache (and weights, per sleep_level) for training: vLLM on GPU;
    the native engine at sleep_level 2 on any device, at level 1 on GPU."""
    sleep_level: int | None = None
    """1 offloads the engine's weights to host memory (GPU), 2 discards them and the trainer re-sends them all
    before the next generation. Level 2 also frees the native engine's copy on CPU, lowering the peak
    memory of the training phases by one model in the rollout dtype, for a full (not incremental) sync
    each step; it needs the actor in the engine's processes (not a split rollout pool). None: the run plan
    decides (2 for the native engine colocated with the actor on CPU hosts without LoRA, else 1)."""
    weight_sync_bucket_mb: int = 0
    """Weights are gathered from the FSDP2 shards and pushed to the engine in buckets of this size (MiB).
    0: 512 on GPU, 32 on CPU, where every large gathered bucket (and gloo's staging copy of it) is fresh
    zeroed pages at each sync (SmolLM2-135M fp32 on 2 CPU ranks: a 1.0-1.2 s sync at 32 against
    3.8-4.7 s at 512, and a lower peak; bench/RESULTS.md)."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Micro-batch size when the rollout worker recomputes log-probs (actor `compute_log_prob`)."""
    log_prob_micro_batch_size: int | None = None
    """veRL's deprecated global form of log_prob_micro_batch_size_per_gpu: rows per log-prob forward over
    all data-parallel ranks, divided by the data-parallel size at start-up (as veRL does) and then
    replacing log_prob_micro_batch_size_per_gpu. None (default): use log_prob_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool = False
    """Actor `compute_log_prob`: pack rows into micro-batches by token count (at most
    log_prob_max_token_len_per_gpu tokens each) instead of log_prob_micro_batch_size_per_gpu rows."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of one log-prob micro-batch on one rank when log_prob_use_dynamic_bsz is on."""
    use_rollout_log_probs: bool = False
    """Bypass mode (veRL): the engine's sampling-time log-probs serve as the PPO old log-probs and the
    actor's old_log_prob pass is skipped. Exact only when the engine computes what the trainer would
    (same weights, dtype, kernels); the update logs the gap (training/rollout_*)."""
    native_impl: NativeImpl = "auto"
    """Native engine forward: "fused" (own decoder over the HF weights with a static KV cache; Qwen2,
    Qwen3, Llama, Mistral), "hf" (drives the HF model with its cache; any causal LM) or "auto"."""
    native_compile: bool = False
    """Native engine, fused decoder: torch.compile the decode step (fullgraph; batch size and cache
    length dynamic, so new batch sizes and lengths reuse the graph). Costs one compile per process on
    the first generate call, 4-30 s on CPU for the tiny model (the low end when torch's on-disk
    compile cache is warm); a compile failure warns once and the engine decodes eagerly. On CPU it
    cuts each decode step by only ~7% (bench/rollout.py: 3.6x -> 3.9x HF generate; the eager step is
    already mostly matmuls and cache reads), so it pays off only for long runs; it is untimed on GPU.
    Greedy output is unchanged (== HF generate); sampling draws the same uniforms, so the same seed
    gives the same tokens unless compiled logits, which may differ from eager in the last bits, flip
    a near-tie."""
    native_prefix_sharing: PrefixSharing = "auto"
    """Native engine, n > 1: each prompt is prefilled once for its n samples (3/4 of the prefill FLOPs
    at n=4). "copy": the prefill's keys and values are copied to the prompt's rows, and decoding is
    what it is without sharing: on one CPU thread per rank (torchrun's default) the same logits bit for
    bit, so the same samples per seed as "off" (when rows are split into decode batches, with
    max_num_seqs a multiple of n); with several threads the prefill over fewer rows may round
    differently (seen: 3e-6 in log-probs). "shared" (fused decoder): one prompt block per prompt plus a
    response block per row, attended
    together, so the cache holds prompts*P + rows*R slots instead of rows*(P+R) and a step reads a
    prompt's keys once for its rows; its logits differ from "off" in the last bits (a prompt's scores
    are one matmul for all its rows), so greedy output is the same but a sampled token can flip where
    its uniform lies within rounding of a CDF boundary (SmolLM2-135M, T=1: one flip in ~500 draws), as with
    native_compile. The HF decoder always copies. "off": every row prefills its own copy of the prompt.
    "auto": "copy" on CPU, "shared" on GPU (where the KV cache bounds the batch)."""
    lora_merge: bool = True
    """Native engine with a LoRA actor (model.lora_rank > 0): true merges the synced adapters into the
    engine's weights (W = W_base + scale * B A, from base weights of the adapted layers kept once; the
    decode step then costs what it costs without LoRA); false keeps the base weights as they are and
    applies the adapters unmerged beside each adapted layer (x A^T B^T * scale: no base copy, nothing
    recomputed at a sync, two small matmuls more per adapted projection and step). bench/lora.py
    --native-unmerged times both. Other engines ignore it."""
    server_urls: list[str] = field(default_factory=list)
    """rollout.name=remote: base URLs of the OpenAI-compatible generation servers (vLLM serve), e.g.
    `--actor_rollout_ref.rollout.server_urls http://gen0:8000 http://gen1:8000`; each request goes to
    the one with the fewest in flight."""
    remote_weights_dir: str = ""
    """rollout.name=remote with remote_weight_sync=vllm: a folder the trainer and every server see at
    this same path; each weight sync writes a safetensors snapshot there (the newest one is kept)."""
    remote_weight_sync: Literal["vllm", "none"] = "vllm"
    """rollout.name=remote: how weights reach the servers: "vllm" (snapshot + /collective_rpc
    reload_weights; servers run with VLLM_SERVER_DEV_MODE=1) or "none" (servers keep their weights)."""
    remote_timeout_s: float = 300.0
    """rollout.name=remote: seconds one HTTP read may wait (a whole response is one read for vLLM)."""
    remote_max_retries: int = 4
    """rollout.name=remote: retries of a request after a transient failure (connection refused / reset,
    timeout, HTTP 5xx / 408 / 429), with exponential backoff from 0.25 s, before the rollout fails."""
    remote_max_concurrency: int = 64
    """rollout.name=remote: most requests in flight at once from this rank (one request per prompt)."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Sampling used for validation."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Agentic multi-turn rollout (tinyzero.agent): the loop of turns, tools or an environment, and the
    tool sandbox, around the engine `name` picks."""

    def __post_init__(self):
        if isinstance(self.val_kwargs, dict):
            self.val_kwargs = ValKwargs(**self.val_kwargs)
        if isinstance(self.multi_turn, dict):
            self.multi_turn = MultiTurnConfig(**self.multi_turn)
        if self.name not in engine_names():
            raise ValueError(f"rollout.name={self.name!r} is not one of {engine_names()}")
        check_sampling("rollout.", self.temperature, self.top_p, self.top_k, self.n)
        if self.prompt_length < 1 or self.response_length < 1:
            raise ValueError("rollout.prompt_length and rollout.response_length must be >= 1")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"rollout.dtype={self.dtype!r} is not one of {DTYPE_NAMES}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.cpu_kv_cache_mb < 0:
            raise ValueError("rollout.cpu_kv_cache_mb must be >= 0 (0 sizes it automatically)")
        if self.tensor_model_parallel_size is not None and self.tensor_model_parallel_size < 1:
            raise ValueError("rollout.tensor_model_parallel_size must be >= 1")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("rollout.max_num_batched_tokens and rollout.max_num_seqs must be >= 1")
        if self.sleep_level not in (None, 1, 2):
            raise ValueError(f"rollout.sleep_level={self.sleep_level} must be 1 or 2")
        if self.weight_sync_bucket_mb < 0:
            raise ValueError("rollout.weight_sync_bucket_mb must be >= 0 (0: 512 on GPU, 32 on CPU)")
        if self.log_prob_micro_batch_size is not None and self.log_prob_micro_batch_size < 1:
            raise ValueError("rollout.log_prob_micro_batch_size must be >= 1 or None")
        if self.log_prob_micro_batch_size_per_gpu < 1:
            raise ValueError("rollout.log_prob_micro_batch_size_per_gpu must be >= 1")
        if self.log_prob_max_token_len_per_gpu < 1:
            raise ValueError("rollout.log_prob_max_token_len_per_gpu must be >= 1 (e.g. 16384)")
        if self.native_prefix_sharing not in PREFIX_SHARING:
            raise ValueError(f"rollout.native_prefix_sharing={self.native_prefix_sharing!r} is not one of "
                             f"{PREFIX_SHARING}")
        if self.native_impl not in NATIVE_IMPLS:
            raise ValueError(f"rollout.native_impl={self.native_impl!r} is not one of {NATIVE_IMPLS}")
        if not self.lora_merge and self.name != "native":
            warnings.warn(f"rollout.lora_merge=false applies to the native engine only; rollout.name={self.name!r} "
                          "ignores it", stacklevel=2)
        self._check_remote()

    def _check_remote(self) -> None:
        if self.name == "remote" and not self.server_urls:
            raise ValueError("rollout.name=remote needs rollout.server_urls (one or more, e.g. "
                             "--actor_rollout_ref.rollout.server_urls http://127.0.0.1:8000)")
        bad = [u for u in self.server_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"rollout.server_urls {bad} must start with http:// or https://")
        if self.remote_weight_sync not in ("vllm", "none"):
            raise ValueError(f"rollout.remote_weight_sync={self.remote_weight_sync!r} is not one of ('vllm', 'none')")
        if self.name == "remote" and self.remote_weight_sync == "vllm" and not self.remote_weights_dir:
            raise ValueError("rollout.name=remote syncs weights through rollout.remote_weights_dir (a folder the "
                             "servers see); set it, or rollout.remote_weight_sync=none to keep the servers' weights")
        if self.remote_timeout_s <= 0 or self.remote_max_retries < 0 or self.remote_max_concurrency < 1:
            raise ValueError("rollout.remote_timeout_s must be > 0, rollout.remote_max_retries >= 0 and "
                             "rollout.remote_max_concurrency >= 1")

    @property
    def max_model_len(self) -> int:
        """Prompt plus response tokens: the longest sequence an engine must hold."""
        return self.prompt_length + self.response_length


def sync_bucket_bytes(config, device=None) -> int:
    """rollout.weight_sync_bucket_mb in bytes, with 0 resolved for `device` (512 MiB on CUDA, else 32)."""
    mb = config.weight_sync_bucket_mb or (512 if getattr(device, "type", str(device)) == "cuda" else 32)
    return mb << 20
