"""Decisions of the CUDA-only paths, tested on CPU: the native prefill's grouped-query attention, the
attention kernel "auto" picks. What SDPA and flash-attn then do on a GPU is checked by scripts/gpu_check.py.
"""

from __future__ import annotations

import pytest
import torch


def _reference(q, k, v, mask, scale):
    """float64 attention with kv heads repeated by a plain loop over query heads."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[1]):
        s = (q[:, h].double() @ k[:, h // group].double().transpose(-1, -2)) * scale
        s = s.masked_fill(~mask[:, 0], float("-inf"))
        out[:, h] = torch.softmax(s, -1) @ v[:, h // group].double()
    return out


@pytest.mark.parametrize("grouped_kv", [True, False])
def test_prefill_attention_grouped_or_repeated_kv_match_float64(grouped_kv):
    from tinyzero.rollout.native.attention import prefill_attention, sdpa_takes_grouped_kv

    assert sdpa_takes_grouped_kv("cpu") and not sdpa_takes_grouped_kv("cuda")
    g = torch.Generator().manual_seed(0)
    b, heads, kv, t, s, d = 2, 6, 2, 5, 9, 8
    q, k, v = (torch.randn(b, n, length, d, generator=g) for n, length in ((heads, t), (kv, s), (kv, s)))
    mask = torch.ones(b, 1, t, s, dtype=torch.bool).tril(s - t)
    mask[1, :, :, :2] = False  # left padding of row 1
    out = prefill_attention(q, k, v, mask, d**-0.5, grouped_kv=grouped_kv)
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, d**-0.5), rtol=0, atol=1e-5)


def test_auto_attention_avoids_flash_attn_in_fp32(monkeypatch):
    from tinyzero.models import loading

    monkeypatch.setattr(loading, "flash_attn_available", lambda: True)
    assert loading.pick_attn_implementation("cuda", "auto", torch.bfloat16) == "flash_attention_2"
    assert loading.pick_attn_implementation("cuda", "auto", torch.float32) == "sdpa"  # flash-attn is 16-bit only
    assert loading.pick_attn_implementation("cpu", "auto", torch.bfloat16) == "sdpa"
    assert loading.pick_attn_implementation("cuda", "auto") == "flash_attention_2"  # dtype not known


def test_two_ranks_on_one_gpu_are_refused_in_one_line():
    """More ranks on a node than visible GPUs would share a device (cuda:LOCAL_RANK % count): refused
    before any process group exists, with the torchrun setting to change."""
    from tinyzero.distributed import check_one_gpu_per_rank

    check_one_gpu_per_rank(8, 8)
    check_one_gpu_per_rank(2, 4)
    with pytest.raises(ValueError, match=r"^2 ranks on this node but 1 GPU\(s\) visible: .*--nproc_per_node 1") as e:
        check_one_gpu_per_rank(2, 1)
    assert "\n" not in str(e.value)
