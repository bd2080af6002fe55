"""What the engines share about their device: the inference dtype (rollout.dtype) and the memory in use."""

from __future__ import annotations

import torch


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """rollout.dtype -> torch dtype ("auto": bf16 on GPU, fp32 on CPU)."""
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return table[name]


def cuda_memory_gb(device: torch.device) -> float:
    """GiB in use on a CUDA device by every allocator (torch's and vLLM's pools alike); 0.0 elsewhere."""
    if device.type != "cuda":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30
