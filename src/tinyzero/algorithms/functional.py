"""Masked reductions shared by every loss and estimator (veRL `torch_functional` numerics).

Every masked statistic in tinyzero goes through these helpers; the constants are veRL's:
masked_mean divides by (mask.sum() + 1e-8), masked_whiten uses rsqrt(var + 1e-8) with the
unbiased (Bessel-corrected) masked variance, and masked_var refuses masks with fewer than two
valid elements (ValueError), as veRL does.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero (NaNs outside the mask are ignored), weighted by mask."""
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean of `values` over the mask: masked_sum / (mask.sum() + 1e-8) (0 for an empty mask)."""
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the mask; unbiased needs at least two valid elements (ValueError otherwise)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("masked_var: the mask selects no element; at least two are needed "
                             "(a batch with only empty responses cannot be whitened)")
        if mask_sum == 1:
            raise ValueError("masked_var: the mask selects one element, the unbiased variance divides by zero; "
                             "use a larger (mini)batch")
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) * rsqrt(var + 1e-8) with mask statistics; applied to every element.

    With shift_mean=False the mean is added back after scaling. Elements outside the mask are
    transformed too (callers multiply by the mask where veRL does).
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Element-wise clamp with tensor bounds: max(min(x, tensor_max), tensor_min)."""
    return torch.max(torch.min(x, tensor_max), tensor_min)
