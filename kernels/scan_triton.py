"""Triton kernels for the reverse scans (GAE, discounted returns) and grouped statistics.

Scans: one program per row. The row is walked in blocks of BLOCK tokens from its end; each
block is loaded in reversed order so that a plain forward `tl.associative_scan` runs
backwards in time, and the state crossing a block boundary is carried in registers. The
scan element is the affine map x -> b + a * x; composing a later map L with an earlier map
E gives (a_L * a_E, b_E + a_E * b_L).

Grouped statistics: per-group count / sum with atomics, then a second launch adds squared
deviations from the group mean (two-pass, so no cancellation from sum-of-squares).

Computation is float32; callers route float64 to the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256


@triton.jit
def _compose(a_later, b_later, a_earlier, b_earlier):
    return a_later * a_earlier, b_earlier + a_earlier * b_later


@triton.jit
def _pick_last(x, BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    return tl.sum(tl.where(idx == BLOCK - 1, x, 0.0), axis=0)


@triton.jit
def _reverse_scan_kernel(a_ptr, b_ptr, out_ptr, length, stride_a, stride_b, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    carry = tl.zeros((), dtype=tl.float32)
    for c in range(0, tl.cdiv(length, BLOCK)):
        t = length - 1 - c * BLOCK - tl.arange(0, BLOCK)  # reversed positions of this block
        valid = t >= 0
        a = tl.load(a_ptr + row * stride_a + t, mask=valid, other=1.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + t, mask=valid, other=0.0).to(tl.float32)
        acc_a, acc_b = tl.associative_scan((a, b), 0, _compose)
        x = acc_b + acc_a * carry
        tl.store(out_ptr + row * stride_o + t, x.to(out_ptr.dtype.element_ty), mask=valid)
        carry = _pick_last(x, BLOCK)


@triton.jit
def _gae_kernel(r_ptr, v_ptr, m_ptr, adv_ptr, ret_ptr, length, stride_r, stride_v, stride_m, stride_o,
                gamma, gamma_lam, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    nv_carry = tl.zeros((), dtype=tl.float32)  # value of the next valid token after this block
    adv_carry = tl.zeros((), dtype=tl.float32)
    for c in range(0, tl.cdiv(length, BLOCK)):
        t = length - 1 - c * BLOCK - tl.arange(0, BLOCK)
        valid = t >= 0
        # nv[t + 1]: scan over the shifted positions t + 1 (identity maps past the end)
        t1 = t + 1
        in1 = valid & (t1 < length)
        m1 = tl.load(m_ptr + row * stride_m + t1, mask=in1, other=0.0).to(tl.float32)
        v1 = tl.load(v_ptr + row * stride_v + t1, mask=in1, other=0.0).to(tl.float32)
        na, nb = tl.associative_scan((1.0 - m1, m1 * v1), 0, _compose)
        next_values = nb + na * nv_carry
        m = tl.load(m_ptr + row * stride_m + t, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * stride_v + t, mask=valid, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + t, mask=valid, other=0.0).to(tl.float32)
        delta = r + gamma * next_values - v
        ga, gb = tl.associative_scan((m * gamma_lam + (1.0 - m), m * delta), 0, _compose)
        adv = gb + ga * adv_carry
        tl.store(adv_ptr + row * stride_o + t, adv.to(adv_ptr.dtype.element_ty), mask=valid)
        tl.store(ret_ptr + row * stride_o + t, (adv + v).to(ret_ptr.dtype.element_ty), mask=valid)
        nv_carry = _pick_last(next_values, BLOCK)
        adv_carry = _pick_last(adv, BLOCK)


@triton.jit
def _group_sum_kernel(x_ptr, g_ptr, cnt_ptr, sum_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inb, other=0)
    tl.atomic_add(cnt_ptr + g, tl.where(inb, 1.0, 0.0), mask=inb)
    tl.atomic_add(sum_ptr + g, x, mask=inb)


@triton.jit
def _group_m2_kernel(x_ptr, g_ptr, cnt_ptr, sum_ptr, m2_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inb, other=0)
    cnt = tl.load(cnt_ptr + g, mask=inb, other=1.0)
    mean = tl.load(sum_ptr + g, mask=inb, other=0.0) / cnt
    d = x - mean
    tl.atomic_add(m2_ptr + g, d * d, mask=inb)


def _block(length: int) -> int:
    return max(16, min(_BLOCK, triton.next_power_of_2(max(length, 1))))


def reverse_linear_scan(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x[t] = b[t] + a[t] * x[t+1] per row; (batch, len) float32/bf16/fp16 in, b's dtype out."""
    a = a.to(b.dtype).contiguous()
    b = b.contiguous()
    out = torch.empty_like(b) if out is None else out
    rows, length = b.shape
    if rows == 0 or length == 0:
        return out
    _reverse_scan_kernel[(rows,)](a, b, out, length, a.stride(0), b.stride(0), out.stride(0),
                                  BLOCK=_block(length))
    return out


def gae_advantage_return(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                         lam: float, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-whitened GAE advantages and returns (see kernels.scan.gae_advantage_return).

    out: optional preallocated contiguous (advantages, returns) to write into.
    """
    rewards, values, mask = rewards.contiguous(), values.contiguous(), mask.contiguous()
    adv, ret = (torch.empty_like(rewards), torch.empty_like(rewards)) if out is None else out
    rows, length = rewards.shape
    if rows == 0 or length == 0:
        return adv, ret
    _gae_kernel[(rows,)](rewards, values, mask, adv, ret, length, rewards.stride(0), values.stride(0),
                         mask.stride(0), adv.stride(0), float(gamma), float(gamma * lam), BLOCK=_block(length))
    return adv, ret


def group_count_mean_m2(scores: torch.Tensor, group: torch.Tensor, num_groups: int):
    """Per-group (count, mean, sum of squared deviations) as float32 tensors of length num_groups."""
    scores = scores.contiguous()
    group = group.contiguous()
    n = scores.numel()
    cnt = torch.zeros(num_groups, dtype=torch.float32, device=scores.device)
    sums = torch.zeros_like(cnt)
    m2 = torch.zeros_like(cnt)
    if n:
        block = 256
        grid = (triton.cdiv(n, block),)
        _group_sum_kernel[grid](scores, group, cnt, sums, n, BLOCK=block)
        _group_m2_kernel[grid](scores, group, cnt, sums, m2, n, BLOCK=block)
    return cnt, sums / cnt.clamp_min(1.0), m2
