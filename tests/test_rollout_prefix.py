"""Prefix-shared rollout in the native engine: a prompt's n samples share one prefill.

Checks, for both modes (rollout.native_prefix_sharing "copy": the prefill's keys copied to the rows;
"shared": a shared prompt block attended with per-row response blocks) and both decoders (fused, HF):
greedy output equal to the unshared path ("off") and to HF generate token for token; sampled output
with a fixed seed equal to the unshared path's ("copy" bit for bit, "shared" within fp32 rounding of a
float64 teacher-forced reference); decode batches split by max_num_seqs (groups split in sub-groups
too) giving the same samples; the shared attention against a float64 loop; the prefill work saved
(tokens through the prefill, cache sizes); and SmolLM2-135M (real weights) against HF generate.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_rollout_native import _engine, _hf_greedy, _prompt_batch, _random_model
from tinyzero.rollout.native.attention import shared_decode_attention
from tinyzero.rollout.native.engine import plan_chunks

MODES = [("fused", "shared"), ("fused", "copy"), ("hf", "shared")]  # the HF decoder always copies


def _run(model, batch, impl: str, mode: str, **cfg):
    return _engine(model, impl, native_prefix_sharing=mode, **cfg).generate_sequences(batch).batch


def _check_log_probs(mode: str, got: torch.Tensor, plain: torch.Tensor) -> None:
    """"copy" decodes exactly as without sharing; "shared" splits the attention sums differently."""
    if mode == "copy":
        assert torch.equal(got, plain)
    else:
        diff = (got - plain).abs().max()
        assert diff < 2e-5, float(diff)


def _teacher_forced_log_probs(model, out, temperature: float) -> torch.Tensor:
    """float64 log_softmax(logits / T) of every response token, from one HF forward over prompt + response."""
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = m64(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                     position_ids=out["position_ids"]).logits
    P = out["prompts"].shape[1]
    return torch.log_softmax(logits[:, P - 1:-1] / temperature, -1).gather(-1, out["responses"][..., None])[..., 0]


@pytest.mark.parametrize("impl,mode", MODES)
def test_greedy_shared_equals_unshared_and_hf_generate(impl, mode):
    model = _random_model()
    n = 3
    batch = _prompt_batch(4, 9, model.config.vocab_size, meta={"n": n})  # left padding 0, 3, 6, 0
    shared = _run(model, batch, impl, mode, response_length=20, do_sample=False)
    plain = _run(model, batch, impl, "off", response_length=20, do_sample=False)
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids", "prompts"):
        assert torch.equal(shared[key], plain[key]), key
    ref = _hf_greedy(model, batch, 20).repeat_interleave(n, 0)
    assert torch.equal(shared["responses"][:, : ref.shape[1]], ref)
    assert (shared["responses"][:, ref.shape[1]:] == 0).all()
    _check_log_probs(mode, shared["rollout_log_probs"], plain["rollout_log_probs"])


@pytest.mark.parametrize("impl,mode", MODES)
def test_sampled_shared_same_samples_as_unshared(impl, mode):
    """Same seed, same tokens as the unshared path (the sampler draws per row); log-probs within fp32
    rounding of a float64 teacher-forced forward (the shared path splits the attention sums in two)."""
    model = _random_model(std=0.15)
    n, T = 4, 0.8
    batch = _prompt_batch(3, 7, model.config.vocab_size, meta={"temperature": T, "seed": 11})
    cfg = dict(response_length=16, n=n, seed=5)
    shared = _run(model, batch, impl, mode, **cfg)
    plain = _run(model, batch, impl, "off", **cfg)
    assert torch.equal(shared["responses"], plain["responses"])
    _check_log_probs(mode, shared["rollout_log_probs"], plain["rollout_log_probs"])
    assert torch.equal(shared["response_mask"], plain["response_mask"])
    r = shared["responses"]
    assert not all(torch.equal(r[n * i], r[n * i + 1]) for i in range(3))  # independent draws per row
    ref = _teacher_forced_log_probs(model, shared, T)
    m = shared["response_mask"].bool()
    for out in (shared, plain):
        err = (out["rollout_log_probs"].double() - ref)[m].abs().max()
        assert err < 2e-5, float(err)


@pytest.mark.parametrize("mode", ["shared", "copy"])
@pytest.mark.parametrize("max_num_seqs", [8, 5, 3])  # 5: not a multiple of n; 3: a group split into sub-groups
def test_decode_batches_by_max_num_seqs_give_the_unshared_samples(max_num_seqs, mode):
    """Decode batches of whole groups (or sub-groups) draw the uniforms the unshared path draws per
    max_num_seqs rows, so the samples are the same. "copy" decodes bit for bit as "off" on one thread
    (torchrun's default per rank) when the batches coincide (max_num_seqs a multiple of n); otherwise
    batches of other sizes round differently."""
    model = _random_model(std=0.15)
    batch = _prompt_batch(3, 6, model.config.vocab_size)
    n = 4
    cfg = dict(response_length=10, n=n, seed=2, max_num_seqs=max_num_seqs)
    # Bit-identity holds per thread count: with several threads the prefill matmul over 3 prompts
    # may be partitioned differently from the one over 12 rows (seen: 3e-6 apart on 2 threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shared = _run(model, batch, "fused", mode, **cfg)
        plain = _run(model, batch, "fused", "off", **cfg)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shared["responses"], plain["responses"])
    _check_log_probs(mode if max_num_seqs % n == 0 else "shared", shared["rollout_log_probs"],
                     plain["rollout_log_probs"])


def test_plan_chunks():
    assert plan_chunks(3, 4, 256) == [(0, 3, 4, 0)]
    assert plan_chunks(3, 4, 5) == [(0, 1, 4, 0), (1, 2, 4, 4), (2, 3, 4, 8)]
    assert plan_chunks(2, 4, 3) == [(0, 1, 3, 0), (0, 1, 1, 3), (1, 2, 3, 4), (1, 2, 1, 7)]
    assert plan_chunks(5, 1, 2) == [(0, 2, 1, 0), (2, 4, 1, 2), (4, 5, 1, 4)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_shared_decode_attention_matches_float64_loop(dtype, tol):
    g = torch.Generator().manual_seed(0)
    Bp, grp, H, KV, D, P, T = 3, 4, 6, 2, 16, 7, 5
    q = torch.randn(Bp * grp, H, D, generator=g)
    kp, vp = torch.randn(Bp, KV, P, D, generator=g), torch.randn(Bp, KV, P, D, generator=g)
    kr, vr = torch.randn(Bp, KV, grp, T, D, generator=g), torch.randn(Bp, KV, grp, T, D, generator=g)
    valid = torch.ones(Bp, P, dtype=torch.bool)
    valid[0, :3] = False  # left padding of prompt 0
    valid[2, :1] = False
    bias = torch.zeros(Bp, P).masked_fill(~valid, float("-inf")).repeat_interleave(KV, 0)[:, None]
    scale = D**-0.5
    got = shared_decode_attention(q.to(dtype), kp.transpose(-1, -2).to(dtype), vp.to(dtype),
                                  kr.transpose(-1, -2).to(dtype), vr.to(dtype), bias, scale)
    ref = torch.zeros(Bp * grp, H, D, dtype=torch.float64)
    for row in range(Bp * grp):
        i, j = divmod(row, grp)
        for h in range(H):
            kv = h // (H // KV)
            keys = torch.cat([kp[i, kv][valid[i]], kr[i, kv, j]]).double()  # (valid P + T, D)
            vals = torch.cat([vp[i, kv][valid[i]], vr[i, kv, j]]).double()
            w = torch.softmax(keys @ q[row, h].double() * scale, dim=0)
            ref[row, h] = w @ vals
    err = (got.double().view(Bp * grp, H, D) - ref).abs().max()
    assert err < tol, float(err)


def test_prefill_runs_each_prompt_once():
    """Prefill FLOPs: both sharing modes push B*P prompt tokens through the model instead of B*n*P; the
    "shared" prompt cache holds B prompts (and a response block per row), "copy" and "off" B*n rows."""
    model = _random_model()
    n, B, P, R = 4, 3, 8, 6
    batch = _prompt_batch(B, P, model.config.vocab_size, meta={"n": n})
    counts = {}
    for mode in ("shared", "copy", "off"):
        engine = _engine(model, "fused", response_length=R, do_sample=False, native_prefix_sharing=mode)
        seen = []
        engine.decoder = _Counting(engine.decoder, seen)
        engine.generate_sequences(batch)
        counts[mode] = sum(seen)
        dec = engine.decoder.inner
        if mode == "shared":
            assert dec.caches[0].k_cache.shape[0] == B and dec.caches[0].max_len == P
            assert tuple(dec.group_caches[0].k_cache.shape[:3]) == (B, model.config.num_key_value_heads, n)
        else:
            assert dec.caches[0].k_cache.shape[0] == B * n and dec.caches[0].max_len == P + R
            assert not dec.group_caches
    assert counts == {"shared": B * P, "copy": B * P, "off": B * n * P}


class _Counting:
    """A decoder wrapper that records the tokens of every prefill call (start == 0)."""

    def __init__(self, inner, seen: list):
        self.inner, self.seen = inner, seen

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, ids, pos, valid, start, **kwargs):
        if start == 0:
            self.seen.append(ids.numel())
        return self.inner(ids, pos, valid, start, **kwargs)


@pytest.mark.slow
def test_real_model_shared_greedy_equals_hf_generate(smollm2_path):
    """SmolLM2-135M-Instruct (real weights, 3 kv heads of 64): chat prompts of different lengths, n=3 rows
    each decoded against one prefill: greedy ("shared") equal to HF generate token for token; sampled
    ("copy") equal to the unshared path bit for bit (tokens and log-probs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinyzero.protocol import DataProto
    from tinyzero.rollout import RolloutConfig, build_rollout

    tok = AutoTokenizer.from_pretrained(smollm2_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    questions = ["What is the capital of France?", "Add 17 and 25.", "Hi"]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]
    enc = tok(texts, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    n, R = 3, 12
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                                meta_info={"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})
    engine = build_rollout(RolloutConfig(response_length=R, n=n, do_sample=False, native_impl="fused",
                                         native_prefix_sharing="shared"), smollm2_path, device="cpu", load_weights=True)
    got = engine.generate_sequences(batch).batch["responses"]
    assert engine.decoder.group_caches and engine.decoder.caches[0].k_cache.shape[0] == len(questions)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=R, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    ref = ref.repeat_interleave(n, 0)
    assert torch.equal(got[:, : ref.shape[1]], ref), (tok.batch_decode(got), tok.batch_decode(ref))
    assert "Paris" in tok.decode(got[0], skip_special_tokens=True)
    sampled = {}
    # "copy" promises the same logits bit for bit as "off" on one thread per rank (torchrun's default):
    # with several threads BLAS may split the prefill over 3 rows and over 9 differently and round
    # differently (documented at rollout.native_prefix_sharing), so the comparison runs on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for mode in ("copy", "off"):
            cfg = RolloutConfig(response_length=R, n=n, seed=4, native_impl="fused", native_prefix_sharing=mode)
            engine = build_rollout(cfg, smollm2_path, device="cpu", load_weights=True)
            sampled[mode] = engine.generate_sequences(batch).batch
    finally:
        torch.set_num_threads(threads)
    for key in ("responses", "rollout_log_probs"):
        assert torch.equal(sampled["copy"][key], sampled["off"][key]), key


class _ActiveRows:
    """A decoder wrapper that records how many rows every decode step computed."""

    def __init__(self, inner, rows: list, compact: bool):
        self.inner, self.rows, self.takes_active_rows = inner, rows, compact

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, ids, pos, valid, start, active=None):
        if ids.shape[1] == 1:
            self.rows.append(ids.shape[0] if active is None else len(active))
        return self.inner(ids, pos, valid, start) if active is None else self.inner(ids, pos, valid, start, active=active)


@pytest.mark.parametrize("mode", ["shared", "copy", "off"])
@pytest.mark.parametrize("do_sample", [True, False])
def test_stopped_rows_leave_the_batch_with_the_same_samples(mode, do_sample):
    """Rows that stopped are dropped from the decode steps' matmuls (fused decoder): the same tokens and
    masks as decoding every row to the end, log-probs within fp32 rounding (matmuls of fewer rows)."""
    model = _random_model(std=0.15)
    n, R = 3, 24
    meta = {"eos_token_id": 1, "stop_token_ids": list(range(2, 12)), "seed": 3}  # ~1 in 9 tokens stops a row
    batch = _prompt_batch(4, 7, model.config.vocab_size, meta=meta)
    outs, rows = {}, {}
    for compact in (True, False):
        engine = _engine(model, "fused", native_prefix_sharing=mode, response_length=R, n=n, seed=5,
                         do_sample=do_sample)
        rows[compact] = []
        engine.decoder = _ActiveRows(engine.decoder, rows[compact], compact)
        outs[compact] = engine.generate_sequences(batch).batch
    got, full = outs[True], outs[False]
    lengths = got["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 3 and int(lengths.min()) < R // 2  # rows stop at varied steps
    assert torch.equal(got["responses"], full["responses"]) and torch.equal(got["response_mask"], full["response_mask"])
    diff = (got["rollout_log_probs"] - full["rollout_log_probs"]).abs().max()
    assert diff < 1e-5, float(diff)
    assert set(rows[False]) == {4 * n} and len(rows[True]) == len(rows[False])
    # Rows leave at the checks (every 4 steps on CPU): what is computed follows the tokens still to come.
    assert sum(rows[True]) < 0.8 * sum(rows[False]), (rows[True], lengths.tolist())
    assert sum(rows[True]) >= int(lengths.sum()) - 4 * n  # never fewer than the tokens sampled after step 0
