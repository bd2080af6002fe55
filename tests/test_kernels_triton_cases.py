"""Triton kernel cases, run under the CPU interpreter by test_kernels_triton.py.

This module only runs in a process started with TRITON_INTERPRET=1 (see test_kernels_triton.py
for why); elsewhere it skips as a whole. Measures: ||out - ref|| / ||ref|| against float64
references under 1e-5 (float32) / 1e-2 (bf16), for outputs and gradients; preallocated outputs
are poisoned with NaN before each launch and non-finite values fail. Shapes are small: the
interpreter runs every program in numpy.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in a TRITON_INTERPRET=1 subprocess started by test_kernels_triton.py", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from tinyzero.kernels import (  # noqa: E402
    discounted_returns,
    gae_advantage_return,
    group_stats,
    linear_log_probs,
    log_probs_from_logits,
)

from tests.test_kernels import (  # noqa: E402
    PEAKED_ABS_TOL,
    assert_rel,
    gae_inputs,
    peaked_logits,
    poisoned,
    ref_gae,
    ref_linear,
    ref_log_probs,
    ref_scan,
)


def _tk():
    from tinyzero.kernels import logprobs_triton, scan_triton

    return logprobs_triton, scan_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,temperature", [((5, 50), 1.0), ((2, 2, 300), 0.7)])
def test_log_probs_kernel(dtype, shape, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    logp, ent = log_probs_from_logits(logits, labels, temperature, return_entropy=True, backend="triton")
    x64 = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = ref_log_probs(x64, labels, temperature)
    assert_rel(logp, ref_lp, dtype, "logp")
    assert_rel(ent, ref_ent, dtype, "entropy")
    g_lp, g_ent = torch.randn(shape[:-1], generator=g), torch.randn(shape[:-1], generator=g)
    (grad,) = torch.autograd.grad((logp * g_lp + ent * g_ent).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), x64)
    assert grad.dtype == dtype
    assert_rel(grad, ref_grad, dtype, "grad")


def test_log_probs_kernel_writes_every_element():
    logprobs_triton, _ = _tk()
    g = torch.Generator().manual_seed(1)
    rows, vocab = 6, 70  # vocab spans several blocks of the smallest block size? no: one block of 128
    logits = torch.randn(rows, vocab, generator=g)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    out = (poisoned(rows), poisoned(rows), poisoned(rows))
    logp, ent, lse = logprobs_triton.rows_forward(logits, labels, 1.0, True, out=out)
    ref_lp, ref_ent = ref_log_probs(logits.double(), labels, 1.0)
    assert_rel(logp, ref_lp, torch.float32)
    assert_rel(ent, ref_ent, torch.float32)
    assert_rel(lse, torch.logsumexp(logits.double(), -1), torch.float32)
    g_lp = torch.randn(rows, generator=g)
    grad = logprobs_triton.rows_backward(logits, labels, lse, ent, g_lp, None, 1.0, out=poisoned(rows, vocab))
    x64 = logits.double().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad((ref_log_probs(x64, labels, 1.0)[0] * g_lp).sum(), x64)
    assert_rel(grad, ref_grad, torch.float32)


def test_log_probs_kernel_many_vocab_blocks(monkeypatch):
    """Force a small vocabulary block so the online max / sum crosses block boundaries."""
    logprobs_triton, _ = _tk()
    monkeypatch.setattr(logprobs_triton, "_block_v", lambda vocab: 16)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 100, generator=g) * 5
    logits[0, 90:] += 20.0  # the max arrives late in the row
    labels = torch.tensor([95, 3, 99])
    logp, ent = log_probs_from_logits(logits, labels, return_entropy=True, backend="triton")
    ref_lp, ref_ent = ref_log_probs(logits.double(), labels, 1.0)
    assert_rel(logp, ref_lp, torch.float32)
    assert_rel(ent, ref_ent, torch.float32)


def test_entropy_of_peaked_distributions_kernel(monkeypatch):
    """Logit scale 30: absolute entropy error under 2e-5, in one vocabulary block and across many."""
    logprobs_triton, _ = _tk()
    logits = peaked_logits(6, 300)
    labels = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(0))
    _, ref_ent = ref_log_probs(logits.double(), labels, 0.6)
    for block in (None, 32):
        if block is not None:
            monkeypatch.setattr(logprobs_triton, "_block_v", lambda vocab, b=block: b)
        _, ent = log_probs_from_logits(logits, labels, 0.6, return_entropy=True, backend="triton")
        err = (ent.double() - ref_ent).abs().max().item()
        assert err < PEAKED_ABS_TOL, f"block {block}: entropy abs error {err:.2e}"
    _, lin_ent = linear_log_probs(torch.eye(6), logits.T.contiguous(), labels, 0.6, return_entropy=True,
                                  backend="triton")
    assert (lin_ent.double() - ref_ent).abs().max().item() < PEAKED_ABS_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_log_probs_triton(dtype):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 4, 16, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(130, 16, generator=g) / 4).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 130, (3, 4), generator=g)
    logp, ent = linear_log_probs(hidden, weight, labels, 1.1, return_entropy=True, chunk_size=5, backend="triton")
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    ref_lp, ref_ent = ref_linear(h64, w64, labels, 1.1)
    assert_rel(logp, ref_lp, dtype, "logp")
    assert_rel(ent, ref_ent, dtype, "entropy")
    g_lp, g_ent = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    gh, gw = torch.autograd.grad((logp * g_lp + ent * g_ent).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), (h64, w64))
    assert_rel(gh, rh, dtype, "grad hidden")
    assert_rel(gw, rw, dtype, "grad weight")


@pytest.mark.parametrize("length", [1, 45, 600])  # 600 > one 256-token block: carries cross blocks
def test_reverse_scan_kernel(length):
    _, scan_triton = _tk()
    g = torch.Generator().manual_seed(length)
    a = torch.rand(3, length, generator=g)
    b = torch.randn(3, length, generator=g)
    out = scan_triton.reverse_linear_scan(a, b, out=poisoned(3, length))
    assert_rel(out, ref_scan(a, b), torch.float32)


@pytest.mark.parametrize("length", [45, 600])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_kernel(length, gamma, lam):
    _, scan_triton = _tk()
    r, v, m = gae_inputs(length, rows=4, length=length)
    adv, ret = scan_triton.gae_advantage_return(r, v, m, gamma, lam,
                                                out=(poisoned(4, length), poisoned(4, length)))
    ref_adv, ref_ret = ref_gae(r, v, m, gamma, lam)
    assert_rel(adv, ref_adv, torch.float32, "advantages")
    assert_rel(ret, ref_ret, torch.float32, "returns")
    adv2, _ = gae_advantage_return(r, v, m, gamma, lam, backend="triton")  # the public dispatch
    assert_rel(adv2, ref_adv, torch.float32)


def test_discounted_returns_kernel():
    r, _, m = gae_inputs(5, rows=3, length=40)
    out = discounted_returns(r, m, 0.9, backend="triton")
    shifted = torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], 1)
    assert_rel(out, ref_scan(0.9 * shifted, r), torch.float32)


def test_group_stats_kernel():
    g = torch.Generator().manual_seed(6)
    ids = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 0])
    scores = torch.randint(0, 3, (12,), generator=g).float() + torch.randn(12, generator=g) * 0.1
    count, mean, m2 = group_stats(scores, ids, 5, backend="triton")
    rc, rm, rm2 = group_stats(scores.double(), ids, 5, backend="torch")
    assert count.tolist() == rc.tolist()
    assert_rel(mean, rm, torch.float32, "mean")
    assert_rel(m2, rm2, torch.float32, "m2")
