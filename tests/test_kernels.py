"""Kernel torch paths against float64 references.

Measure: ||out - ref|| / ||ref|| with the reference in float64 computed from the same
(rounded) inputs: float32 inputs under 1e-5, bf16 inputs under 1e-2, for outputs and
gradients. Non-finite values always fail; preallocated outputs are poisoned with NaN first so
an element a kernel forgets to write fails too. The Triton kernels run the same checks in
test_kernels_triton.py (under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import pytest
import torch
from tinyzero.kernels import (
    discounted_returns,
    entropy_from_logits,
    gae_advantage_return,
    group_ids,
    group_mean_std,
    group_stats,
    linear_log_probs,
    log_probs_from_logits,
    reverse_linear_scan,
)
from tinyzero.kernels.logprobs import rows_backward_torch, rows_forward_torch

REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite output"
    return (torch.linalg.norm(out.double() - ref.double()) / torch.linalg.norm(ref.double()).clamp_min(1e-30)).item()


def assert_rel(out, ref, dtype, what=""):
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"{what}: relative error {err:.3e} >= {REL_TOL[dtype]:.0e}"


def poisoned(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype)


# ----------------------------------------------------------------------------- references
def ref_log_probs(logits64: torch.Tensor, labels: torch.Tensor, temperature: float):
    """(logp, entropy) in float64; differentiable."""
    logp_all = torch.log_softmax(logits64 / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def ref_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double().tolist(), b.double().tolist()
    out = []
    for ra, rb in zip(a, b):
        x, row = 0.0, [0.0] * len(ra)
        for t in reversed(range(len(ra))):
            x = rb[t] + ra[t] * x
            row[t] = x
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def ref_gae(r, v, m, gamma, lam):
    rows, length = r.shape
    r, v, m = r.double(), v.double(), m.double()
    adv = torch.zeros(rows, length, dtype=torch.float64)
    next_value = torch.zeros(rows, dtype=torch.float64)
    last = torch.zeros(rows, dtype=torch.float64)
    for t in reversed(range(length)):  # veRL's loop, in float64
        delta = r[:, t] + gamma * next_value - v[:, t]
        new_last = delta + gamma * lam * last
        next_value = v[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = new_last * m[:, t] + (1 - m[:, t]) * last
        adv[:, t] = last
    return adv, adv + v


def gae_inputs(seed, rows=6, length=45, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (rows,), generator=g)
    lengths[0], lengths[1] = 0, 1
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    mask[-1] = (torch.rand(length, generator=g) > 0.3).float()  # a row with holes
    r = torch.randn(rows, length, generator=g) * mask
    v = torch.randn(rows, length, generator=g)
    return r.to(dtype), v.to(dtype), mask.to(dtype)


# ----------------------------------------------------------------------------- log-probs
LOGIT_CASES = [((7, 50), 1.0), ((2, 3, 257), 0.7), ((1, 1000), 1.3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,temperature", LOGIT_CASES)
def test_log_probs_torch_path(dtype, shape, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    logp, ent = log_probs_from_logits(logits, labels, temperature, return_entropy=True, backend="torch")
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32 and logp.shape == labels.shape
    x64 = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = ref_log_probs(x64, labels, temperature)
    assert_rel(logp, ref_lp, dtype, "logp")
    assert_rel(ent, ref_ent, dtype, "entropy")
    g_lp, g_ent = torch.randn(shape[:-1], generator=g), torch.randn(shape[:-1], generator=g)
    (grad,) = torch.autograd.grad((logp * g_lp + ent * g_ent).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), x64, retain_graph=True)
    assert grad.dtype == dtype
    assert_rel(grad, ref_grad, dtype, "grad")
    only_lp = log_probs_from_logits(logits, labels, temperature, backend="torch")
    (grad_lp,) = torch.autograd.grad((only_lp * g_lp).sum(), logits)
    (ref_grad_lp,) = torch.autograd.grad((ref_lp * g_lp).sum(), x64)
    assert_rel(grad_lp, ref_grad_lp, dtype, "grad of logp alone")


def test_row_helpers_write_every_element():
    g = torch.Generator().manual_seed(1)
    rows, vocab = 9, 33
    logits = torch.randn(rows, vocab, generator=g)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    out = (poisoned(rows), poisoned(rows), poisoned(rows))
    logp, ent, lse = rows_forward_torch(logits, labels, 1.0, True, out=out)
    ref_lp, ref_ent = ref_log_probs(logits.double(), labels, 1.0)
    assert_rel(logp, ref_lp, torch.float32)
    assert_rel(ent, ref_ent, torch.float32)
    assert_rel(lse, torch.logsumexp(logits.double(), -1), torch.float32)
    grad = rows_backward_torch(logits, labels, lse, ent, torch.ones(rows), None, 1.0, out=poisoned(rows, vocab))
    assert torch.isfinite(grad).all()


def test_entropy_from_logits_and_edge_shapes():
    logits = torch.randn(4, 5, 11, dtype=torch.float32)
    assert_rel(entropy_from_logits(logits), ref_log_probs(logits.double(), torch.zeros(4, 5, dtype=torch.long), 1.0)[1],
               torch.float32)
    empty = log_probs_from_logits(torch.randn(0, 7), torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,)
    with pytest.raises(ValueError, match="labels shape"):
        log_probs_from_logits(torch.randn(3, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        log_probs_from_logits(torch.randn(3, 7), torch.zeros(3, dtype=torch.long), temperature=0.0)
    if os.environ.get("TRITON_INTERPRET") != "1":  # CPU tensors need the interpreter for Triton
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            log_probs_from_logits(torch.randn(3, 7), torch.zeros(3, dtype=torch.long), backend="triton")


PEAKED_ABS_TOL = 2e-5  # entropy, absolute, float32 logits at logit scale 30 (a plain fp32 torch formula: ~2e-6)


def peaked_logits(rows: int, vocab: int, scale: float = 30.0, seed: int = 5) -> torch.Tensor:
    """float32 logits of nearly one-hot distributions (entropies from ~0 to ~1 nat), rounded once."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale).float()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_of_peaked_distributions(temperature):
    logits = peaked_logits(16, 1000)
    labels = torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(0))
    _, ref_ent = ref_log_probs(logits.double(), labels, temperature)
    _, ent = log_probs_from_logits(logits, labels, temperature, return_entropy=True, backend="torch")
    err = (ent.double() - ref_ent).abs().max().item()
    assert err < PEAKED_ABS_TOL, f"entropy abs error {err:.2e}"
    # linear_log_probs on the same logits: hidden = identity rows, weight = logits^T
    weight = logits.T.contiguous()  # (V, 16)
    _, lin_ent = linear_log_probs(torch.eye(16), weight, labels, temperature, return_entropy=True, backend="torch")
    err = (lin_ent.double() - ref_ent).abs().max().item()
    assert err < PEAKED_ABS_TOL, f"linear entropy abs error {err:.2e}"


def test_float64_inputs_keep_float64():
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(3, 4, 37, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    labels = torch.randint(0, 37, (3, 4), generator=g)
    logp, ent = log_probs_from_logits(logits, labels, 0.8, return_entropy=True)
    assert logp.dtype == torch.float64 and ent.dtype == torch.float64
    assert entropy_from_logits(logits.detach()).dtype == torch.float64
    x64 = logits.detach().clone().requires_grad_(True)
    ref_lp, ref_ent = ref_log_probs(x64, labels, 0.8)
    assert_rel(logp, ref_lp, torch.float64, "logp")
    assert_rel(ent, ref_ent, torch.float64, "entropy")
    (grad,) = torch.autograd.grad((logp + ent).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_lp + ref_ent).sum(), x64)
    assert grad.dtype == torch.float64
    assert_rel(grad, ref_grad, torch.float64, "grad")
    hidden = torch.randn(2, 5, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(41, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, 41, (2, 5), generator=g)
    logp, ent = linear_log_probs(hidden, weight, labels, return_entropy=True, chunk_size=3)
    assert logp.dtype == torch.float64 and ent.dtype == torch.float64
    h64, w64 = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    ref_lp, ref_ent = ref_linear(h64, w64, labels, 1.0)
    assert_rel(logp, ref_lp, torch.float64, "linear logp")
    assert_rel(ent, ref_ent, torch.float64, "linear entropy")
    gh, gw = torch.autograd.grad((logp + ent).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_lp + ref_ent).sum(), (h64, w64))
    assert gh.dtype == torch.float64 and gw.dtype == torch.float64
    assert_rel(gh, rh, torch.float64, "linear grad hidden")
    assert_rel(gw, rw, torch.float64, "linear grad weight")


# ----------------------------------------------------------------------------- linear log-probs
def ref_linear(h64, w64, labels, temperature):
    return ref_log_probs(h64 @ w64.T, labels, temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 3, 64])
def test_linear_log_probs_torch_path(dtype, chunk):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 16, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(301, 16, generator=g) / 4).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 301, (2, 5), generator=g)
    logp, ent = linear_log_probs(hidden, weight, labels, 0.9, return_entropy=True, chunk_size=chunk, backend="torch")
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    ref_lp, ref_ent = ref_linear(h64, w64, labels, 0.9)
    assert_rel(logp, ref_lp, dtype, "logp")
    assert_rel(ent, ref_ent, dtype, "entropy")
    g_lp, g_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    gh, gw = torch.autograd.grad((logp * g_lp + ent * g_ent).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), (h64, w64))
    assert gh.dtype == dtype and gw.dtype == dtype
    assert_rel(gh, rh, dtype, "grad hidden")
    assert_rel(gw, rw, dtype, "grad weight")


@pytest.mark.parametrize("keep", [0, 1 << 20, 3 * 301 * 4])  # none kept; all; the first 3-token chunk only
def test_linear_log_probs_torch_path_keeps_forward_logits(monkeypatch, keep):
    """Backward reuses the forward's logit tiles within `keep_logits_bytes` (no recompute of those), and
    the gradients still match float64 (tiles of 256 vocabulary entries: the last one ragged)."""
    from tinyzero.kernels import linear_logprobs as ll

    monkeypatch.setattr(ll, "_TORCH_TILE_ELEMS", 600)  # (3 tokens, 301 vocab) -> tiles of 256 and 45
    calls = []
    tile_logits = ll._tile_logits
    monkeypatch.setattr(ll, "_tile_logits", lambda *a: calls.append(1) or tile_logits(*a))
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 6, 16, generator=g).requires_grad_(True)
    weight = (torch.randn(301, 16, generator=g) / 4).requires_grad_(True)
    labels = torch.randint(0, 301, (2, 6), generator=g)
    logp, ent = linear_log_probs(hidden, weight, labels, 0.9, return_entropy=True, chunk_size=3, backend="torch",
                                 keep_logits_bytes=keep)
    forward_calls = len(calls)
    assert forward_calls == 4 * 2  # 4 token chunks x 2 vocabulary tiles
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    ref_lp, ref_ent = ref_linear(h64, w64, labels, 0.9)
    g_lp, g_ent = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    gh, gw = torch.autograd.grad((logp * g_lp + ent * g_ent).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), (h64, w64))
    recomputed_chunks = {0: 4, 1 << 20: 0, 3 * 301 * 4: 3}[keep]
    assert len(calls) - forward_calls == 2 * recomputed_chunks
    assert_rel(gh, rh, torch.float32, "grad hidden")
    assert_rel(gw, rw, torch.float32, "grad weight")
    with torch.no_grad():  # nothing to keep without a gradient
        calls.clear()
        linear_log_probs(hidden, weight, labels, chunk_size=3, backend="torch", keep_logits_bytes=keep)


def test_linear_log_probs_tied_embedding():
    """lm_head tied to the input embedding: the weight gradient sums both uses."""
    torch.manual_seed(3)
    vocab, dim = 97, 12
    emb = torch.nn.Embedding(vocab, dim)
    proj = torch.nn.Linear(dim, dim)
    ids = torch.randint(0, vocab, (3, 7))
    labels = torch.randint(0, vocab, (3, 7))

    def loss_fn(use_kernel: bool):
        emb.zero_grad()
        proj.zero_grad()
        hidden = torch.tanh(proj(emb(ids)))  # (3, 7, dim)
        if use_kernel:
            logp = linear_log_probs(hidden, emb.weight, labels, chunk_size=5, backend="torch")
        else:
            logp = torch.log_softmax((hidden.double() @ emb.weight.double().T), -1).gather(
                -1, labels.unsqueeze(-1)).squeeze(-1)
        logp.sum().backward()
        return logp.detach(), emb.weight.grad.clone(), proj.weight.grad.clone()

    ours, naive = loss_fn(True), loss_fn(False)
    for o, n, what in zip(ours, naive, ("logp", "embedding grad", "proj grad")):
        assert_rel(o, n, torch.float32, what)


def test_linear_log_probs_frozen_weight_and_validation():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(20, 8)
    labels = torch.randint(0, 20, (4,))
    logp = linear_log_probs(hidden, weight, labels, backend="torch")
    (gh,) = torch.autograd.grad(logp.sum(), hidden)
    h64 = hidden.detach().double().requires_grad_(True)
    (rh,) = torch.autograd.grad(ref_linear(h64, weight.double(), labels, 1.0)[0].sum(), h64)
    assert_rel(gh, rh, torch.float32)
    with pytest.raises(ValueError, match="weight must be"):
        linear_log_probs(hidden, torch.randn(20, 9), labels)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_log_probs(hidden, weight, labels, chunk_size=0)


# ----------------------------------------------------------------------------- scans and group stats
@pytest.mark.parametrize("length", [1, 2, 7, 64, 300])
def test_reverse_linear_scan_torch(length):
    g = torch.Generator().manual_seed(length)
    a = torch.rand(5, length, generator=g)
    b = torch.randn(5, length, generator=g)
    assert_rel(reverse_linear_scan(a, b, backend="torch"), ref_scan(a, b), torch.float32)
    assert_rel(reverse_linear_scan(a.double(), b.double(), backend="torch"), ref_scan(a, b), torch.float64)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_torch_path(gamma, lam):
    r, v, m = gae_inputs(0)
    adv, ret = gae_advantage_return(r, v, m, gamma, lam, backend="torch")
    ref_adv, ref_ret = ref_gae(r, v, m, gamma, lam)
    assert_rel(adv, ref_adv, torch.float32, "advantages")
    assert_rel(ret, ref_ret, torch.float32, "returns")


def test_discounted_returns_torch_path():
    r, _, m = gae_inputs(1)
    out = discounted_returns(r, m, 0.9, backend="torch")
    shifted = torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], 1)
    assert_rel(out, ref_scan(0.9 * shifted, r), torch.float32)


def test_group_statistics():
    scores = torch.tensor([1.0, 2.0, 2.0, 0.5, 3.0, 3.0, 3.0, -1.0, 4.0])
    uid = ["b", "a", "a", "c", "d", "d", "d", "e", "e"]
    ids, num = group_ids(uid)
    assert num == 5 and ids.tolist() == [1, 0, 0, 2, 3, 3, 3, 4, 4]
    mean, std, count = group_mean_std(scores, ids, num, backend="torch")
    assert count.tolist() == [2, 1, 1, 3, 2]
    torch.testing.assert_close(mean, torch.tensor([2.0, 0.0, 0.0, 3.0, 1.5], dtype=torch.float64))
    torch.testing.assert_close(std, torch.tensor([0.0, 1.0, 1.0, 0.0, 5 / 2 ** 0.5], dtype=torch.float64))
    cnt, mean2, m2 = group_stats(scores, ids, num, backend="torch")
    torch.testing.assert_close(m2, torch.tensor([0.0, 0.0, 0.0, 0.0, 12.5], dtype=torch.float64))
    mixed, n_mixed = group_ids(["x", 1, "x", 1])
    assert n_mixed == 2 and mixed[0] == mixed[2] and mixed[1] == mixed[3]


@pytest.mark.parametrize("c", [0.0, 0.5, 0.97, 1.0])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 4500])  # 4500 > 64 * 64: two carry levels
def test_discounted_reverse_cumsum(c, length):
    from tinyzero.kernels.scan import discounted_reverse_cumsum

    g = torch.Generator().manual_seed(length)
    x = torch.randn(3, length, generator=g)
    ref = ref_scan(torch.full((3, length), c, dtype=torch.float64), x)
    assert_rel(discounted_reverse_cumsum(x, c), ref, torch.float32)
    assert_rel(discounted_reverse_cumsum(x.double(), c), ref, torch.float64)


def test_right_padded_detection_picks_the_general_path_for_holes():
    from tinyzero.kernels.scan import is_right_padded

    assert is_right_padded(torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 1, 1]]))
    assert not is_right_padded(torch.tensor([[1.0, 0, 1]]))
    assert not is_right_padded(torch.tensor([[0.5, 0.5, 0]]))


def test_linear_log_probs_many_vocab_tiles(monkeypatch):
    """Tiny vocabulary tiles: the online log-sum-exp / entropy and the label scatter cross tiles."""
    from tinyzero.kernels import linear_logprobs

    monkeypatch.setattr(linear_logprobs, "_vocab_block", lambda tokens, vocab: 7)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    weight.data[35:] += 3.0  # the row max arrives in the last (partial) tile
    labels = torch.tensor([0, 6, 7, 34, 35, 39])
    logp, ent = linear_log_probs(hidden, weight, labels, 0.8, return_entropy=True, chunk_size=4, backend="torch")
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    ref_lp, ref_ent = ref_linear(h64, w64, labels, 0.8)
    assert_rel(logp, ref_lp, torch.float32, "logp")
    assert_rel(ent, ref_ent, torch.float32, "entropy")
    g_lp, g_ent = torch.randn(6, generator=g), torch.randn(6, generator=g)
    gh, gw = torch.autograd.grad((logp * g_lp + ent * g_ent).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_lp * g_lp + ref_ent * g_ent).sum(), (h64, w64))
    assert_rel(gh, rh, torch.float32, "grad hidden")
    assert_rel(gw, rw, torch.float32, "grad weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_grad_accumulates_in_float32_without_float32_copies(dtype):
    """The head's weight gradient over token chunks (the Triton path's accumulation) against a float64
    sum: exact to float32 rounding for float32 chunks; for bf16 / fp16 chunks each chunk's product is
    one low-precision GEMM rounded once, so the sum is within a few units of that dtype's epsilon."""
    from tinyzero.kernels.linear_logprobs import accumulate_weight_grad

    gen = torch.Generator().manual_seed(0)
    vocab, hidden, chunks = 96, 24, [(16, 0), (16, 1), (7, 2)]
    grad_w, ref = torch.zeros(vocab, hidden), torch.zeros(vocab, hidden, dtype=torch.float64)
    for tokens, _ in chunks:
        g = torch.randn(tokens, vocab, generator=gen).to(dtype)
        h = torch.randn(tokens, hidden, generator=gen).to(dtype)
        accumulate_weight_grad(grad_w, g, h)
        ref += g.double().T @ h.double()
    assert grad_w.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    scale = ref.abs().max().item()
    assert (grad_w.double() - ref).abs().max().item() <= tol * scale


def test_auto_backend_falls_back_to_torch_when_triton_cannot_compile(monkeypatch, recwarn):
    """backend="auto" on a device where Triton's first kernel fails: one warning naming the cause, then the
    torch path for every later call (the probe runs once per device); CPU tensors never take Triton."""
    import importlib.util

    from tinyzero.kernels import _backend

    monkeypatch.setattr(_backend, "HAS_TRITON", True)
    monkeypatch.setattr(_backend, "_triton_works", {})
    probes, real_probe = [], _backend._probe
    monkeypatch.setattr(_backend, "_probe", lambda device: probes.append(device) or real_probe(device))
    cause = "No module named 'triton'"
    if importlib.util.find_spec("triton") is not None:
        import tinyzero.kernels.scan_triton as scan_triton

        cause = "Failed to find C compiler"

        def broken(a, b):
            raise RuntimeError(cause + ". Please specify via CC environment variable.")

        monkeypatch.setattr(scan_triton, "reverse_linear_scan", broken)
    with pytest.warns(RuntimeWarning, match=f"cannot run on cpu .*{cause}.*torch path"):
        assert _backend.auto_triton(True, "cpu") is False
    recwarn.clear()
    assert _backend.auto_triton(True, "cpu") is False  # decided once per device: no second probe or warning
    assert probes == ["cpu"] and not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert _backend.auto_triton(False, "cpu") is False
