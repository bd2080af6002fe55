"""The vLLM rollout engine ("vllm"): an in-process vLLM per rank.

engine.py holds `VLLMRollout`; backend.py holds every call into vLLM, checked on the version it
names, so a vLLM upgrade touches that file only. vLLM itself is imported there, lazily.
"""

from tinyzero.rollout.vllm.engine import VLLMRollout

__all__ = ["VLLMRollout"]
