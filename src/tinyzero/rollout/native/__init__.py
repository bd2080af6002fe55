"""The native rollout engine ("native"): batched generation in plain torch, on CPU or GPU.

engine.py holds `NativeRollout`; decoder.py picks its forward (the fused decoder over the HF weights
with a static KV cache: attention.py, fused_ops.py, kv_cache.py, its tensor-parallel split in
decoder_tp.py over tp_comm.py; or hf_decoder.py, any HF causal LM). Its generation loop and sampler
sit one level up (generate.py, sampling.py): their stop rules also cut the other engines' responses.
"""

from tinyzero.rollout.native.engine import NativeRollout

__all__ = ["NativeRollout"]
