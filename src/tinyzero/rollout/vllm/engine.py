"""The vLLM rollout engine: an in-process vLLM per rank behind the rollout interface.

Every rank of the torchrun world builds its engine (`external_launcher`); ranks
[k*tp, (k+1)*tp) form tensor-parallel group k and must call generate_sequences with the same
prompts (the worker dispatches by data-parallel rank = rank // tp) and the same call order,
which also keeps their seeds equal. The engine starts from dummy weights: the trainer pushes
real ones with `update_weights` before the first rollout.

GPU memory phases (driven by the worker, in this order so weights stay valid):
    engine.wake_up(["weights"]); engine.update_weights(...); engine.wake_up(["kv_cache"])
    out = engine.generate_sequences(batch); engine.sleep()
On CPU, sleep / wake_up do nothing (vLLM has no sleep mode there).

LoRA (lora_rank > 0): the engine runs vLLM's own LoRA layers. The base weights come once (the first
`update_weights`, or the checkpoint), then every sync is `update_adapter`: the adapters alone, registered
in memory as a new adapter version (a fresh LoRARequest id; the previous version is removed), and every
generate call runs with the latest one.
"""

from __future__ import annotations

import warnings

import torch

from tinyzero.protocol import DataProto
from tinyzero.rollout.config import RolloutConfig
from tinyzero.rollout.device import cuda_memory_gb, resolve_dtype
from tinyzero.rollout.engine import sampling_params
from tinyzero.rollout.outputs import (
    build_output,
    check_prompt_batch,
    pad_responses,
    raw_prompt_token_ids,
    repeat_prompts,
)
from tinyzero.rollout.vllm import backend


class VLLMRollout:
    """Rollout engine over `vllm.LLM` (see module docstring)."""

    def __init__(self, config: RolloutConfig, model_path: str, hf_config, device: torch.device | str,
                 dp_rank: int = 0, load_dummy: bool = True, trust_remote_code: bool = False, lora_rank: int = 0):
        reason = backend.vllm_available()
        if reason is not None:
            raise ValueError(f"rollout.name='vllm' but {reason}; install vllm or set rollout.name='native'")
        backend.check_version()
        self.config = config
        self.device = torch.device(device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.dp_rank = dp_rank
        self.num_calls = 0
        self.llm = backend.make_llm(model_path, config, hf_config, self.dtype, seed=config.seed,
                                         load_dummy=load_dummy, trust_remote_code=trust_remote_code,
                                         max_lora_rank=lora_rank)
        self.lora_rank = lora_rank
        self.lora_request = None  # the adapter version generate runs with (None: the base model)
        self.adapter_nbytes = 0  # bytes of the last adapter registered
        self._asleep = False
        self._warned_truncation = False
        self.prefix_cache_stats: dict[str, int] = {}  # of the last generate call (backend.generate)
        self.memory: dict[str, float] = {"after_init_gb": cuda_memory_gb(self.device)}

    def update_weights(self, named_tensors) -> None:
        """Load (hf_name, full tensor) pairs (consumed lazily, layer by layer); resets the prefix cache."""
        backend.sync_weights(self.llm, named_tensors)
        self.memory["after_sync_gb"] = cuda_memory_gb(self.device)

    @property
    def serves_adapters(self) -> bool:
        """Whether LoRA adapters are synced as adapters (`update_adapter`) rather than merged into weights."""
        return self.lora_rank > 0

    def update_adapter(self, named_tensors, peft_config: dict) -> int:
        """Register a new adapter version from (hf_name, full tensor) pairs of lora_A / lora_B weights and its
        PEFT adapter_config (a dict); generate uses it from now on. Returns the number of tensors."""
        from tinyzero.models.lora import PEFT_PREFIX

        if not self.serves_adapters:
            raise ValueError("update_adapter needs a LoRA engine; build it with lora_rank = model.lora_rank > 0")
        tensors = {PEFT_PREFIX + name: t.detach().to("cpu", copy=True) for name, t in named_tensors}
        if int(peft_config["r"]) > self.lora_rank:
            raise ValueError(f"adapter rank {peft_config['r']} is above the engine's lora_rank={self.lora_rank}")
        version = 1 if self.lora_request is None else self.lora_request.lora_int_id + 1
        self.lora_request = backend.add_lora(self.llm, version, tensors, peft_config)
        self.adapter_nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return len(tensors)

    def sleep(self) -> None:
        """GPU with free_cache_engine: release the KV cache (and weights, per sleep_level)."""
        if self.config.free_cache_engine and not self._asleep:
            backend.sleep(self.llm, self.config.sleep_level or 1)
            self._asleep = True
            self.memory["after_sleep_gb"] = cuda_memory_gb(self.device)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what sleep freed; tags among ("weights", "kv_cache"), None for both."""
        if self._asleep:
            backend.wake_up(self.llm, tags)
            if tags is None or "kv_cache" in tags:
                self._asleep = False
            self.memory[f"after_wake_{'_'.join(tags or ['all'])}_gb"] = cuda_memory_gb(self.device)

    def memory_metrics(self) -> dict[str, float]:
        """Device memory in use (GiB, all allocators) after each phase; {} off GPU (nothing is tracked)."""
        if self.device.type != "cuda":
            return {}
        return {f"rollout/mem_{k}": v for k, v in self.memory.items()}

    def shutdown(self) -> None:
        """End the engine; the last call of the job: vLLM's teardown also destroys torch.distributed's
        default process group. Not needed at exit (the engine is released with the process)."""
        if self.llm is not None:
            backend.shutdown(self.llm)
            self.llm = None

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        check_prompt_batch(prompts)
        params = sampling_params(self.config, prompts.meta_info, self.num_calls, self.dp_rank)
        self.num_calls += 1
        if not params.greedy and (params.top_k > 0 or params.top_p < 1.0) and not self._warned_truncation:
            warnings.warn("vLLM reports log-probs of the top-k/top-p truncated distribution; the trainer "
                          "recomputes untruncated ones, so rollout and trainer log-probs differ", stacklevel=2)
            self._warned_truncation = True
        tokens, logprobs = backend.generate(self.llm, raw_prompt_token_ids(prompts), params, params.seed,
                                                 stats=self.prefix_cache_stats, lora_request=self.lora_request)
        responses, response_mask, log_probs = pad_responses(
            tokens, logprobs, params.response_length, params.pad_token_id, params.stop_token_ids, params.stop_sequences)
        ids, mask, pos = repeat_prompts(prompts, params.n)
        # The temperature the log-probs were taken at (greedy: none, they are at T = 1), for compute_log_prob.
        meta = {} if params.greedy else {"temperature": params.temperature}
        if self.lora_request is not None:  # the adapter version served and the bytes its sync moved
            meta["metrics"] = {"rollout/lora_version": self.lora_request.lora_int_id,
                               "rollout/lora_sync_bytes": self.adapter_nbytes}
        return build_output(ids.cpu(), mask.cpu(), pos.cpu(), responses, response_mask, log_probs, meta_info=meta)
