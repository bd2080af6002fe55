"""The on-device sampler against the exact distribution (temperature, top-k, top-p) on a small vocab."""

from __future__ import annotations

import math

import pytest
import torch

from tinyzero.rollout.sampling import SampleBuffers, SamplingParams, make_generator, sample_from_logits

LOGITS = [2.0, 1.5, 1.1, 0.7, 0.3, 0.0, -0.4, -1.0, -1.7, -2.5]


def exact_distribution(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Plain-Python float64 reference: softmax(l / T) restricted to top-k, then to the top-p nucleus."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = order[:top_k] if top_k > 0 else order
    z = sum(math.exp(scaled[i]) for i in keep)
    probs = {i: math.exp(scaled[i]) / z for i in keep}
    if top_p < 1.0:
        nucleus, mass = [], 0.0
        for i in keep:  # most likely first; stop once the mass reaches top_p
            nucleus.append(i)
            mass += probs[i]
            if mass >= top_p:
                break
        z = sum(probs[i] for i in nucleus)
        probs = {i: probs[i] / z for i in nucleus}
    return [probs.get(i, 0.0) for i in range(len(logits))]


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, -1, 1.0), (0.5, -1, 1.0), (2.0, -1, 1.0), (1.0, 4, 1.0), (1.0, -1, 0.7), (0.8, 6, 0.9), (1.3, -1, 0.35),
])
def test_sampling_matches_exact_distribution(temperature, top_k, top_p):
    num = 40_000
    logits = torch.tensor(LOGITS).repeat(num, 1)  # (num, vocab): one draw per row
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, do_sample=True)
    tokens, logp = sample_from_logits(logits, params, make_generator(torch.device("cpu"), 123))
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    freq = counts / num
    ref = torch.tensor(exact_distribution(LOGITS, temperature, top_k, top_p), dtype=torch.float64)
    # Tokens outside the truncated support are never drawn.
    assert counts[ref == 0].sum() == 0
    tv = 0.5 * (freq - ref).abs().sum().item()
    # sqrt(p(1-p)/N) summed over 10 tokens is < 0.01 at N = 40k; 0.02 is a > 4-sigma bound.
    assert tv < 0.02, (tv, freq.tolist(), ref.tolist())
    support = ref > 0
    chi2 = (((counts - num * ref)[support]) ** 2 / (num * ref[support])).sum().item()
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, chi2  # far in the chi-square tail otherwise
    # Reported log-prob is log_softmax(logits / T) of the drawn token, before truncation.
    full = torch.log_softmax(torch.tensor(LOGITS, dtype=torch.float64) / temperature, -1)
    assert torch.allclose(logp.double(), full[tokens], atol=1e-5)


def test_greedy_and_seeded_reproducibility():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g)
    tokens, logp = sample_from_logits(logits, SamplingParams(do_sample=False), None)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logp, torch.log_softmax(logits, -1).max(-1).values)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    a, _ = sample_from_logits(logits, params, make_generator(torch.device("cpu"), 5))
    b, _ = sample_from_logits(logits, params, make_generator(torch.device("cpu"), 5))
    c, _ = sample_from_logits(logits, params, make_generator(torch.device("cpu"), 6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_resolve_sampling_params_overrides():
    from tinyzero.rollout.config import RolloutConfig, ValKwargs
    from tinyzero.rollout.sampling import resolve_sampling_params

    cfg = RolloutConfig(n=4, temperature=0.9, top_p=0.95, response_length=32,
                        val_kwargs=ValKwargs(n=2, temperature=0.5, do_sample=True))
    p = resolve_sampling_params(cfg, {"eos_token_id": [5, 7], "pad_token_id": 0}, seed=3)
    assert (p.n, p.temperature, p.top_p, p.stop_token_ids, p.response_length, p.seed) == (4, 0.9, 0.95, [5, 7], 32, 3)
    p = resolve_sampling_params(cfg, {"eos_token_id": 5, "pad_token_id": 0, "validate": True}, seed=3)
    assert (p.n, p.temperature, p.top_p, p.do_sample) == (2, 0.5, 1.0, True)
    p = resolve_sampling_params(cfg, {"eos_token_id": 5, "pad_token_id": 0, "do_sample": False, "n": 1}, seed=3)
    assert p.greedy and p.n == 1
    with pytest.raises(ValueError, match="pad_token_id"):
        resolve_sampling_params(cfg, {"eos_token_id": 5}, seed=3)


def test_inverse_cdf_edges_never_pick_masked_tokens():
    """The extreme uniforms (0 and the largest float64 below 1) land on the first and last kept token in
    vocabulary order, never on a masked one; a plain-Python cumulative sum is the reference for the rest."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0, 2.5]]).repeat(5, 1)  # top-3 keeps tokens 1, 3, 5
    params = SamplingParams(temperature=1.0, top_k=3, do_sample=True)
    below_one = math.nextafter(1.0, 0.0)
    uniforms = torch.tensor([0.0, below_one, 0.25, 0.5, 0.9], dtype=torch.float64)
    tokens, _ = sample_from_logits(logits, params, None, uniforms)
    kept = [1, 3, 5]
    weights = [math.exp(x) if i in kept else 0.0 for i, x in enumerate(logits[0].tolist())]
    total = sum(weights)

    def reference(u: float) -> int:
        mass = 0.0
        for i, w in enumerate(weights):
            mass += w
            if mass > u * total:
                return i
        raise AssertionError("u * total reached the total mass")

    assert tokens.tolist() == [reference(u) for u in uniforms.tolist()]
    assert tokens[0] == 1 and tokens[1] == 5
    # Non-finite logits (a broken model) still give in-range token ids, so the batch can be reported.
    bad = torch.full((2, 6), float("nan"))
    tokens, _ = sample_from_logits(bad, SamplingParams(do_sample=True), None, uniforms[:2])
    assert ((tokens >= 0) & (tokens < 6)).all()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_reused_buffers_sample_like_fresh_tensors(temperature, top_p):
    """One SampleBuffers over the steps of a generation whose rows shrink (stopped rows leave the batch)
    gives the fresh tensors' tokens and log-probs bit for bit, and the tokens are the plain-Python
    inverse-CDF draws; the buffers are allocated once, at the first (largest) step."""
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=temperature, top_p=top_p, do_sample=True)
    buffers = SampleBuffers()
    ptrs = set()
    for rows in (8, 8, 5, 3, 6):
        logits = torch.randn(rows, 300, generator=g) * 3
        uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
        fresh = sample_from_logits(logits, params, None, uniforms)
        reused = sample_from_logits(logits, params, None, uniforms, buffers)
        assert torch.equal(fresh[0], reused[0]) and torch.equal(fresh[1], reused[1])
        ptrs.add(buffers.get("cdf", logits, torch.float64).data_ptr())
        if top_p < 1.0:
            continue  # the nucleus is the other tests' business; here the draws of the full softmax
        probs = torch.log_softmax(logits / temperature, -1).exp()  # fp32, as the sampler draws from
        for r in range(rows):
            weights = probs[r].tolist()
            target, mass = uniforms[r].item() * sum(weights), 0.0  # the running float64 sum, left to right
            expected = next(i for i, w in enumerate(weights) if (mass := mass + w) > target)
            assert reused[0][r].item() == expected, (rows, r)
    assert len(ptrs) == 1
