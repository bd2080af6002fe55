"""tinyzero: RL post-training for LLMs in pure PyTorch (SPMD, FSDP2, in-process vLLM)."""

__version__ = "0.1.0"
