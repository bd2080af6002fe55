"""Rollout engines behind one interface, and weight sync from the trainer.

    engine = build_rollout(config, model_path, tokenizer, hf_config, device)
    engine.update_weights(iter_full_params(actor_module, config.weight_sync_bucket_mb << 20))
    out = engine.generate_sequences(prompt_batch)  # prompts, responses, input_ids, attention_mask,
                                                   # position_ids, response_mask, rollout_log_probs
    engine.sleep(); engine.wake_up(tags=None)

"native" (native.py) runs anywhere torch runs; "vllm" (vllm_rollout.py) is vLLM in-process.

Decisions (numbers from bench/rollout.py on the 2-core CPU machine):
* The native engine generates from its own inference copy of the model, fed by
  `iter_full_params` before each rollout, rather than under FSDP2 with parameters unsharded.
  Both move the same bytes (one all-gather per bucket vs one per layer group; about 4 s/GB each
  on 2 gloo ranks), but the copy lets generation use the static KV cache and fused decoder with
  no FSDP hooks per decode step, keeps the trainer's (fp32) weights sharded throughout, holds at
  most a bucket of gathered tensors while syncing (unsharding holds the whole fp32 model for the
  rollout), and on GPU sleeps in host memory between rollouts.
* Log-probs: log_softmax(logits / T) of the sampled token over the full vocabulary, the
  trainer's convention (sampling.py); vLLM matches it exactly when top-k / top-p are off.
* Rows of one prompt are adjacent: prompt i -> rows i*n .. i*n+n-1.
"""

from __future__ import annotations

import torch

from tinyzero.rollout.config import RolloutConfig, ValKwargs
from tinyzero.rollout.weight_sync import iter_full_params

__all__ = ["RolloutConfig", "ValKwargs", "build_rollout", "iter_full_params"]


def build_rollout(config: RolloutConfig, model_path: str, tokenizer=None, hf_config=None,
                  device: torch.device | str | None = None, dp_rank: int = 0, load_weights: bool = False,
                  trust_remote_code: bool = False):
    """Build the engine named by config.name on `device`.

    model_path: the HF folder (vLLM reads its config; the native engine reads weights from it only
    when load_weights is True). hf_config: the model's config (read from model_path when None).
    dp_rank: this rank's data-parallel index (rank // tensor_model_parallel_size); it decorrelates
    the samplers of different DP ranks. load_weights: start from the checkpoint's weights instead of
    waiting for update_weights. tokenizer is accepted for interface symmetry (engines work on ids).
    """
    del tokenizer
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                               local_files_only=True)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    if config.name == "native":
        from tinyzero.rollout.native import NativeRollout

        return NativeRollout(config, hf_config, device, model_path=model_path if load_weights else None,
                             dp_rank=dp_rank, trust_remote_code=trust_remote_code)
    if config.name == "vllm":
        from tinyzero.rollout.vllm_rollout import VLLMRollout

        return VLLMRollout(config, model_path, hf_config, device, dp_rank=dp_rank, load_dummy=not load_weights,
                           trust_remote_code=trust_remote_code)
    raise ValueError(f"rollout.name={config.name!r}: use 'native' or 'vllm'")
