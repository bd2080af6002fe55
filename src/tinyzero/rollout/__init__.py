"""Rollout engines behind one interface, and weight sync from the trainer.

    engine = build_rollout(config, model_path, tokenizer, hf_config, device)
    engine.update_weights(iter_full_params(actor_module, sync_bucket_bytes(config, device)))
    out = engine.generate_sequences(prompt_batch)  # prompts, responses, input_ids, attention_mask,
                                                   # position_ids, response_mask, rollout_log_probs
    engine.sleep(); engine.wake_up(tags=None)

The layout: engine.py is the interface (`RolloutEngine`, the typed `SamplingParams`), registry.py the
engine registry and `build_rollout`, and each engine is a folder: native/ (runs anywhere torch runs),
vllm/ (vLLM in-process), remote/ (OpenAI-compatible HTTP servers); "auto" picks vLLM where it is usable
and a GPU is present. The modules beside them are what several engines or the workers share: config.py,
outputs.py (the batch every engine returns), generate.py and sampling.py (the generation loop and
sampler), device.py, weight_bridge.py, partial.py and multi_turn.py.

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

from tinyzero.distributed.full_params import iter_full_params
from tinyzero.rollout.config import RolloutConfig, ValKwargs
from tinyzero.rollout.engine import RolloutEngine, SamplingParams, sampling_params
from tinyzero.rollout.registry import ENGINES, build_rollout, register_engine

__all__ = ["ENGINES", "RolloutConfig", "RolloutEngine", "SamplingParams", "ValKwargs", "build_rollout",
           "iter_full_params", "register_engine", "sampling_params"]
