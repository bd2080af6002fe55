"""bench/train_scaling.py at a tiny size: its collective counter against the traffic FSDP2 must
produce, and its GPU MFU code path run dry on CPU (tp=1 and tp=2 over gloo) so it keeps working on
machines without a GPU."""

from __future__ import annotations

import pytest
import torch

from bench.train_scaling import gpu_mfu, parse_args, spawn_run

pytestmark = pytest.mark.slow

TINY = ["--rows", "4", "--seq", "32", "--steps", "1", "--gpu_dry", "--run_timeout_s", "300"]


def test_dp2_collectives_match_fsdp2_traffic(tiny_model_dir):
    """ZeRO-2 FSDP2 over 2 ranks all-gathers every parameter once per step and reduce-scatters every
    gradient once; both buffers hold the fp32 parameters with each dim 0 padded to a multiple of 2."""
    from transformers import AutoModelForCausalLM

    res = spawn_run(2, tiny_model_dir, parse_args(TINY))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    padded = sum(-(-p.shape[0] // 2) * 2 * (p.numel() // p.shape[0]) * 4 for p in model.parameters())
    by_op = res["comm"]["by_op"]
    groups = model.config.num_hidden_layers + 1  # one FSDP2 group per layer and the root
    assert by_op["_allgather_base_"] == {"calls": groups, "bytes": padded, "mib": round(padded / 2**20, 3)}
    assert by_op["_reduce_scatter_base_"] == {"calls": groups, "bytes": padded, "mib": round(padded / 2**20, 3)}
    assert res["tokens_per_s"] > 0 and res["max_rank_cpu_s_per_step"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU form of the dry run (tp=2 on 2 gloo ranks)")
def test_gpu_mfu_path_runs_dry_on_cpu():
    out = gpu_mfu(parse_args(TINY))
    assert out["gpu_dry"] and out["gpu"] == "cpu" and out["gpu_mfu"] is None and out["gpu_tp2_mfu"] is None
    assert out["gpu_tokens_per_s"] > 0 and out["gpu_tp2_tokens_per_s"] > 0
    assert out["gpu_comm_mib_per_step"] == 0  # one rank
    assert out["gpu_tp2_comm_mib_per_step"] > 0  # the tensor-parallel collectives were seen
