"""Native rollout engine: greedy == HF generate, masks and stops, log-probs, seeds, weight updates."""

from __future__ import annotations

import pytest
import torch

from tinyzero.protocol import DataProto
from tinyzero.rollout import RolloutConfig, ValKwargs, build_rollout
from tinyzero.rollout.native import NativeRollout


def _random_model(kind: str = "qwen2", seed: int = 0, std: float = 0.3):
    """A small random HF model with logits far from uniform (so greedy is not decided by ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=1, pad_token_id=0, bos_token_id=None)
    if kind == "qwen2":
        cfg, cls = Qwen2Config(tie_word_embeddings=True, **common), Qwen2ForCausalLM
    else:
        cfg, cls = LlamaConfig(tie_word_embeddings=False, attention_bias=True, **common), LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def _prompt_batch(batch: int, length: int, vocab: int, seed: int = 0, meta: dict | None = None) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for i in range(batch):
        pad = (i * 3) % length
        mask[i, :pad] = 0
        ids[i, :pad] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    meta = {"eos_token_id": 1, "pad_token_id": 0, **(meta or {})}
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, meta_info=meta)


def _engine(model, impl="fused", **cfg) -> NativeRollout:
    engine = NativeRollout(RolloutConfig(native_impl=impl, **cfg), model.config, "cpu")
    assert engine.update_weights(model.state_dict().items()) == len(model.state_dict())
    return engine


def _hf_greedy(model, batch: DataProto, length: int) -> torch.Tensor:
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=length, do_sample=False,
                         eos_token_id=1, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("kind,impl", [("qwen2", "fused"), ("qwen2", "hf"), ("llama", "fused")])
def test_greedy_equals_hf_generate_random_model(kind, impl):
    model = _random_model(kind)
    batch = _prompt_batch(5, 9, model.config.vocab_size)
    out = _engine(model, impl, response_length=24, do_sample=False).generate_sequences(batch)
    ref = _hf_greedy(model, batch, 24)
    got = out.batch["responses"]
    assert torch.equal(got[:, : ref.shape[1]], ref)
    assert (got[:, ref.shape[1]:] == 0).all()


def test_any_causal_lm_through_hf_decoder():
    """A non-Llama architecture (GPT-2: learned positions, fused c_attn) runs through the HF decoder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tinyzero.rollout.native.decoder import HFDecoder

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                       eos_token_id=1, pad_token_id=0, bos_token_id=1)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # sharper logits
    batch = _prompt_batch(4, 7, 96)
    engine = _engine(model, "auto", response_length=12, do_sample=False)
    assert isinstance(engine.decoder, HFDecoder)
    ref = _hf_greedy(model, batch, 12)
    assert torch.equal(engine.generate_sequences(batch).batch["responses"][:, : ref.shape[1]], ref)


def test_greedy_equals_hf_generate_tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    texts = ["What is 12 + 7?", "Hi", "Count down from 10 to 1 using 3, 4 and 5.", "a b\nc"]
    enc = tok(texts, return_tensors="pt", padding=True)
    mask = enc["attention_mask"]
    batch = DataProto.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
        meta_info={"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})
    engine = build_rollout(RolloutConfig(response_length=32, do_sample=False), tiny_model_dir, tok,
                           device="cpu", load_weights=True)
    out = engine.generate_sequences(batch)
    ref = model.generate(enc["input_ids"], attention_mask=mask, max_new_tokens=32, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:]
    assert torch.equal(out.batch["responses"][:, : ref.shape[1]], ref)


def test_output_layout_masks_and_stop():
    model = _random_model()
    batch = _prompt_batch(4, 8, model.config.vocab_size)
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    free = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[:, 8:]  # (4, 16), no stopping
    unused = next(t for t in range(2, 96) if not (free == t).any())
    # A token produced mid-way by prompt 0 becomes a stop id: row 0 must stop at its first occurrence.
    stop_tok = int(free[0, 5])
    first = int((free[0] == stop_tok).nonzero()[0])
    batch.meta_info["eos_token_id"] = unused
    n = 3
    batch.meta_info.update(stop_token_ids=[stop_tok], n=n)
    out = _engine(model, response_length=16, do_sample=False).generate_sequences(batch)
    b = out.batch
    P, R = 8, 16
    assert b["responses"].shape == (4 * n, R) and b["input_ids"].shape == (4 * n, P + R)
    assert torch.equal(b["prompts"], batch.batch["input_ids"].repeat_interleave(n, 0))
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    # Greedy: the n rows of a prompt are identical and interleaved.
    assert torch.equal(b["responses"][0], b["responses"][n - 1])
    row0_len = first + 1
    assert b["response_mask"][0].tolist() == [1] * row0_len + [0] * (R - row0_len)
    assert torch.equal(b["responses"][0, :row0_len], free[0, :row0_len])
    assert (b["responses"][0, row0_len:] == 0).all()
    assert (b["rollout_log_probs"][0, row0_len:] == 0).all()
    # Every row: mask is a prefix of ones ending at the first stop token (or full length).
    stops = torch.tensor([unused, stop_tok])
    for i in range(4 * n):
        toks, m = b["responses"][i], b["response_mask"][i]
        k = int(m.sum())
        assert m[:k].all() and not m[k:].any()
        hit = torch.isin(toks[:k], stops).nonzero()
        assert (k == R and len(hit) == 0) or int(hit[0]) == k - 1
    assert torch.equal(b["attention_mask"][:, P:], b["response_mask"])
    assert torch.equal(b["attention_mask"][:, :P], batch.batch["attention_mask"].repeat_interleave(n, 0))
    pos = b["position_ids"]
    assert torch.equal(pos[:, P:], pos[:, P - 1: P] + torch.arange(1, R + 1))


def test_rollout_log_probs_match_teacher_forced_hf():
    model = _random_model(std=0.15)
    batch = _prompt_batch(4, 6, model.config.vocab_size, meta={"temperature": 0.7})
    out = _engine(model, response_length=12, n=2, top_k=-1, top_p=1.0).generate_sequences(batch)
    b = out.batch
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits.double()
    P = b["prompts"].shape[1]
    lp = torch.log_softmax(logits[:, P - 1:-1] / 0.7, -1).gather(-1, b["responses"][..., None])[..., 0]
    m = b["response_mask"].bool()
    diff = (lp[m] - b["rollout_log_probs"].double()[m]).abs()
    assert diff.max() < 1e-4, float(diff.max())


def test_same_seed_same_output_and_fresh_calls_differ():
    model = _random_model(std=0.1)
    batch = _prompt_batch(3, 6, model.config.vocab_size)
    cfg = dict(response_length=10, n=2, seed=7)
    a1 = _engine(model, **cfg).generate_sequences(batch)
    e2 = _engine(model, **cfg)
    a2 = e2.generate_sequences(batch)
    assert torch.equal(a1.batch["responses"], a2.batch["responses"])
    a3 = e2.generate_sequences(batch)
    assert not torch.equal(a2.batch["responses"], a3.batch["responses"])
    # The n samples of one prompt are independent draws, not copies.
    r = a1.batch["responses"]
    assert not all(torch.equal(r[2 * i], r[2 * i + 1]) for i in range(3))


def test_batch_seed_repeats_per_rank_and_differs_across_ranks():
    """A trainer-set meta_info seed replays exactly on one DP rank, and other DP ranks get other noise."""
    model = _random_model(std=0.1)
    batch = _prompt_batch(4, 6, model.config.vocab_size, meta={"seed": 123})
    cfg = dict(response_length=12, n=2, seed=7)
    outs = {}
    for rank in (0, 0, 1):
        engine = _engine(model, **cfg)
        engine.dp_rank = rank
        outs.setdefault(rank, []).append(engine.generate_sequences(batch).batch["responses"])
    assert torch.equal(outs[0][0], outs[0][1])
    assert not torch.equal(outs[0][0], outs[1][0])


def test_update_weights_in_place_changes_output():
    old, new = _random_model(seed=0), _random_model(seed=1)
    batch = _prompt_batch(3, 6, old.config.vocab_size)
    engine = _engine(old, response_length=12, do_sample=False)
    before = engine.generate_sequences(batch).batch["responses"]
    # What a GPU sleep / wake does to the copy: caches dropped, every parameter given new storage
    # (breaking the fused q/k/v and gate/up views), then new weights pushed in.
    engine.decoder.release()
    engine.model.to(torch.float64).to(torch.float32)
    engine.update_weights((k, v.clone()) for k, v in new.state_dict().items())
    after = engine.generate_sequences(batch).batch["responses"]
    ref = _hf_greedy(new, batch, 12)
    assert not torch.equal(before, after)
    assert torch.equal(after[:, : ref.shape[1]], ref)
    with pytest.raises(ValueError, match="not a parameter"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))])


@pytest.mark.parametrize("impl", ["fused", "hf"])
def test_sleep_level_2_discards_the_weights_until_every_one_is_synced(impl):
    """rollout.sleep_level=2: sleep frees every parameter (tied ones once) and the caches; generation refuses
    until a sync has written every weight again, then equals HF greedy of the synced model."""
    old, new = _random_model(seed=0), _random_model(seed=1)
    batch = _prompt_batch(3, 6, old.config.vocab_size)
    engine = _engine(old, impl=impl, response_length=12, do_sample=False, sleep_level=2)
    engine.generate_sequences(batch)
    engine.sleep()
    assert all(p.numel() == 0 for p in engine.model.parameters())
    engine.wake_up(tags=["kv_cache"])  # the weights stay discarded
    assert all(p.numel() == 0 for p in engine.model.parameters())
    engine.wake_up(tags=["weights"])
    assert [p.shape for p in engine.model.parameters()] == [p.shape for p in new.parameters()]
    state = new.state_dict()
    engine.update_weights((k, v.clone()) for k, v in state.items() if k != "model.norm.weight")
    with pytest.raises(RuntimeError, match="'model.norm.weight'"):
        engine.generate_sequences(batch)
    engine.update_weights([("model.norm.weight", state["model.norm.weight"])])
    ref = _hf_greedy(new, batch, 12)
    assert torch.equal(engine.generate_sequences(batch).batch["responses"][:, : ref.shape[1]], ref)
    engine.sleep()  # a sync straight after sleep allocates the weights itself
    engine.update_weights((k, v.clone()) for k, v in old.state_dict().items())
    assert torch.equal(engine.generate_sequences(batch).batch["responses"][:, : ref.shape[1]], _hf_greedy(old, batch, 12))


def test_validate_uses_val_kwargs_and_chunking():
    model = _random_model()
    batch = _prompt_batch(5, 6, model.config.vocab_size, meta={"validate": True})
    cfg = dict(response_length=8, n=4, do_sample=True, max_num_seqs=2, val_kwargs=ValKwargs(n=1))
    out = _engine(model, **cfg).generate_sequences(batch)
    assert len(out) == 5  # val_kwargs.n, greedy (val_kwargs.do_sample False)
    ref = _hf_greedy(model, batch, 8)
    assert torch.equal(out.batch["responses"][:, : ref.shape[1]], ref)


def test_config_validation():
    with pytest.raises(ValueError, match="rollout.top_p"):
        RolloutConfig(top_p=0.0)
    with pytest.raises(ValueError, match="rollout.top_k"):
        RolloutConfig(top_k=0)
    with pytest.raises(ValueError, match="rollout.name"):
        RolloutConfig(name="sglang")
    with pytest.raises(ValueError, match="val_kwargs.n"):
        RolloutConfig(val_kwargs={"n": 0})
    with pytest.raises(ValueError, match="left-padded"):
        model = _random_model()
        b = _prompt_batch(2, 4, 96)
        b.batch["attention_mask"][:, -1] = 0
        _engine(model, response_length=2).generate_sequences(b)


@pytest.mark.slow
def test_compiled_decode_step_matches_eager_and_hf():
    """rollout.native_compile: the compiled decode step gives HF generate's greedy tokens, a new batch
    size reuses the compiled graph, and sampling with the same seed gives the eager engine's tokens."""
    model = _random_model()
    batch = _prompt_batch(5, 9, model.config.vocab_size)
    engine = _engine(model, response_length=24, do_sample=False, native_compile=True)
    out = engine.generate_sequences(batch).batch["responses"]
    assert engine.decoder._compiled is not None  # compiled, not fallen back to eager
    ref = _hf_greedy(model, batch, 24)
    assert torch.equal(out[:, : ref.shape[1]], ref)
    other = _prompt_batch(7, 11, model.config.vocab_size, seed=1)
    ref2 = _hf_greedy(model, other, 24)
    assert torch.equal(engine.generate_sequences(other).batch["responses"][:, : ref2.shape[1]], ref2)
    assert engine.decoder._compiled is not None
    cfg = dict(response_length=16, n=2, seed=3)
    sampled = _engine(model, native_compile=True, **cfg).generate_sequences(batch).batch
    eager = _engine(model, **cfg).generate_sequences(batch).batch
    assert torch.equal(sampled["responses"], eager["responses"])
    # Compiled and eager sum in different orders; each is ~1.4e-5 from a float64 teacher-forced reference
    # here (log-probs down to -7), so they are held to that fp32 rounding scale, not to bit equality.
    diff = (sampled["rollout_log_probs"] - eager["rollout_log_probs"]).abs().max()
    assert diff < 2e-5, float(diff)
    b = eager
    with torch.no_grad():
        logits = model.double()(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                position_ids=b["position_ids"]).logits
    P = b["prompts"].shape[1]
    ref_lp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, b["responses"][..., None])[..., 0]
    m = b["response_mask"].bool()
    for out in (sampled, eager):
        err = (out["rollout_log_probs"].double() - ref_lp)[m].abs().max()
        assert err < 2e-5, float(err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_mm_is_one_matmul_bit_for_bit(dtype):
    """fused_ops.wide_mm (column blocks for wide fp32 outputs) returns torch.mm's result bit for bit, for
    any number of rows and a last block that is shorter."""
    from tinyzero.rollout.native import fused_ops

    g = torch.Generator().manual_seed(0)
    n = fused_ops.WIDE_MM_COLUMNS + fused_ops.WIDE_MM_BLOCK // 3  # a ragged last block
    weight = torch.randn(n, 96, generator=g).to(dtype)
    for rows in (1, 2, 5, 32):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        got = fused_ops.wide_mm(x, weight.t())
        assert got.shape == (rows, n) and got.dtype == dtype
        assert torch.equal(got, torch.mm(x, weight.t())), rows
    if dtype == torch.float32:  # under autograd: one differentiable call, the same gradient as torch.mm's
        w = weight.clone().requires_grad_()
        fused_ops.wide_mm(x, w.t()).sum().backward()
        ref = w.detach().clone().requires_grad_()
        torch.mm(x, ref.t()).sum().backward()
        assert torch.equal(w.grad, ref.grad)


def test_column_blocked_lm_head_decodes_like_hf(monkeypatch):
    """With blocks small enough that the random model's lm_head (vocab 96) splits into 40-column blocks
    (the last one 16), greedy decoding still equals HF generate and the sampled tokens and log-probs
    equal the unblocked engine's exactly."""
    from tinyzero.rollout.native import fused_ops

    model = _random_model()
    batch = _prompt_batch(5, 9, model.config.vocab_size, meta={"temperature": 0.8})
    unblocked = _engine(model, response_length=16, n=2).generate_sequences(batch)
    monkeypatch.setattr(fused_ops, "WIDE_MM_COLUMNS", 64)
    monkeypatch.setattr(fused_ops, "WIDE_MM_BLOCK", 40)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(a[1].shape[1]) or real_mm(*a, **k))
    blocked = _engine(model, response_length=16, n=2).generate_sequences(batch)
    assert 40 in calls and 16 in calls  # the lm_head went through blocks, the last one shorter
    for key in ("responses", "response_mask", "rollout_log_probs"):
        assert torch.equal(blocked.batch[key], unblocked.batch[key]), key
    prompts = _prompt_batch(5, 9, model.config.vocab_size)
    greedy = _engine(model, response_length=24, do_sample=False).generate_sequences(prompts)
    ref = _hf_greedy(model, prompts, 24)
    assert torch.equal(greedy.batch["responses"][:, : ref.shape[1]], ref)
