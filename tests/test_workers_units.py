"""Unit tests of the worker building blocks: lr schedules, micro-batching, padding trim, loss scaling."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tinyzero.protocol import DataProto
from tinyzero.workers.batching import (
    balanced_partitions,
    restore_order,
    split_dynamic,
    split_fixed,
    trim_padding,
)
from tinyzero.workers.optim import build_lr_scheduler, constant_lr_factor, cosine_lr_factor, num_warmup_steps


def _optim_config(**kw):
    from tinyzero.workers.config import OptimConfig

    return OptimConfig(**kw)


def _lrs(cfg, steps):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=cfg.lr)
    sched = build_lr_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_constant_schedule_with_warmup():
    cfg = _optim_config(lr=1e-3, lr_warmup_steps=4)
    lrs = _lrs(cfg, 8)
    expected = [1e-3 * min(1.0, s / 4) for s in range(8)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=0)
    # No warmup: the first step already uses the full learning rate.
    assert _lrs(_optim_config(lr=1e-3), 3) == pytest.approx([1e-3] * 3)


def test_cosine_schedule_reference():
    cfg = _optim_config(lr=2.0, warmup_style="cosine", lr_warmup_steps_ratio=0.2, total_training_steps=10,
                        min_lr_ratio=0.1)
    assert num_warmup_steps(cfg) == 2
    lrs = _lrs(cfg, 11)
    for s, lr in enumerate(lrs):
        if s < 2:
            ref = 2.0 * s / 2
        else:
            progress = (s - 2) / 8
            ref = 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        assert lr == pytest.approx(ref, rel=1e-12, abs=1e-15), s
    assert lrs[-1] == pytest.approx(0.2)  # decays to min_lr_ratio * lr
    assert cosine_lr_factor(5, 0, 10) == pytest.approx(0.5)
    assert constant_lr_factor(0, 0) == 1.0


def test_cosine_needs_total_steps():
    with pytest.raises(ValueError, match="total_training_steps"):
        _lrs(_optim_config(warmup_style="cosine"), 1)
    with pytest.raises(ValueError, match="warmup_style"):
        _optim_config(warmup_style="linear")


def test_balanced_partitions_cover_and_balance():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 40)
        w = [rng.randint(1, 100) for _ in range(n)]
        k = rng.randint(1, n)
        parts = balanced_partitions(w, k)
        assert len(parts) == k and all(parts)
        assert sorted(i for p in parts for i in p) == list(range(n))
        loads = [sum(w[i] for i in p) for p in parts]
        # LPT bound: the heaviest group is at most the mean plus one item.
        assert max(loads) <= sum(w) / k + max(w)


def _batch(lengths_prompt, lengths_resp, p=6, r=5):
    b = len(lengths_prompt)
    attn = torch.zeros(b, p + r, dtype=torch.long)
    for i, (lp, lr) in enumerate(zip(lengths_prompt, lengths_resp)):
        attn[i, p - lp:p] = 1
        attn[i, p:p + lr] = 1
    ids = torch.randint(0, 50, (b, p + r)) * attn
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": pos,
                                "responses": ids[:, p:], "row": torch.arange(b)})


def test_dynamic_split_respects_budget_and_restores_order():
    data = _batch([6, 2, 3, 1, 5, 4, 2, 6], [5, 1, 2, 5, 3, 1, 4, 2])
    seqlens = data.batch["attention_mask"].sum(-1).tolist()
    micros, parts = split_dynamic(data, max_token_len=12)
    assert len(micros) >= math.ceil(sum(seqlens) / 12)
    for m in micros:
        assert int(m.batch["attention_mask"].sum()) <= 12
    rows = torch.cat([m.batch["row"] for m in micros])
    assert torch.equal(restore_order(rows, parts), torch.arange(8))
    with pytest.raises(ValueError, match="token budget"):
        split_dynamic(data, max_token_len=8)


def test_fixed_split():
    data = _batch([1] * 6, [1] * 6)
    assert [len(m) for m in split_fixed(data, 4)] == [4, 2]
    assert [len(m) for m in split_fixed(data, None)] == [6]


def test_trim_padding_keeps_real_tokens(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    data = _batch([2, 3], [2, 1], p=6, r=5)
    ids, mask, pos = data.batch["input_ids"], data.batch["attention_mask"], data.batch["position_ids"]
    t_ids, t_mask, t_pos, kept = trim_padding(ids, mask, pos, 5)
    assert kept == 2 and t_ids.shape[1] == 3 + 2
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        trimmed = model(input_ids=t_ids, attention_mask=t_mask, position_ids=t_pos).logits
    # Real positions: prompt tail and the kept responses, aligned at the prompt/response boundary.
    for i in range(2):
        for col in range(6 - 3, 6 + 2):
            if mask[i, col]:
                torch.testing.assert_close(trimmed[i, col - 3], full[i, col], rtol=1e-5, atol=1e-5)


def _reference_agg(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    """The mini-batch loss each mode defines, written out per row in float64."""
    rows = []
    for lrow, mrow in zip(loss.double().tolist(), mask.double().tolist()):
        rows.append((sum(a * b for a, b in zip(lrow, mrow)), sum(mrow)))
    if mode == "token-mean":
        return sum(s for s, _ in rows) / sum(n for _, n in rows)
    nonempty = [(s, n) for s, n in rows if n > 0]
    if mode == "seq-mean-token-sum":
        return sum(s for s, _ in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in nonempty) / len(nonempty)
    return sum(s for s, _ in rows) / loss.shape[1] / len(rows)  # seq-mean-token-sum-norm


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("num_micro", [1, 2, 3, 12])
def test_micro_batch_shares_sum_to_mini_batch_loss(mode, num_micro):
    from tinyzero.algorithms import agg_loss
    from tinyzero.workers.scaling import global_counts, micro_weight

    g = torch.Generator().manual_seed(1)
    loss = torch.randn(12, 7, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 0, 3, 1, 5, 7, 2, 0, 4, 6, 1, 3])  # includes empty rows
    mask = (torch.arange(7) < lengths[:, None]).double()
    counts = global_counts(mask)
    order = torch.randperm(12, generator=g)  # any grouping of rows
    total = 0.0
    for idx in order.chunk(num_micro):
        m, lm = mask[idx], loss[idx]
        if m.sum() == 0 and mode != "seq-mean-token-sum-norm":
            # No valid token: agg_loss is 0/0; the workers back-propagate a zero loss instead.
            assert micro_weight(mode, m, counts) == 0.0
            continue
        total += float(agg_loss(lm, m, mode)) * micro_weight(mode, m, counts)
    # agg_loss adds 1e-8 to per-row token counts in seq-mean-token-mean: relative error ~1e-8 there.
    tol = 1e-7 if mode == "seq-mean-token-mean" else 1e-12
    assert total == pytest.approx(_reference_agg(loss, mask, mode), rel=tol, abs=tol)


def _plain_actor(model_dir, **actor_kw):
    from transformers import AutoModelForCausalLM

    from tinyzero.workers.actor import PPOActor
    from tinyzero.workers.config import ActorConfig
    from tinyzero.workers.forward import attach_log_prob_method
    from tinyzero.workers.optim import build_lr_scheduler, build_optimizer

    model = attach_log_prob_method(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    cfg = ActorConfig(ppo_mini_batch_size=4, **actor_kw)
    opt = build_optimizer(model.parameters(), cfg.optim)
    return PPOActor(cfg, model, opt, build_lr_scheduler(opt, cfg.optim))


def _ppo_batch():
    from tests.workers_helpers import make_batch

    raw = make_batch(4, prompt_len=5, response_len=4)
    keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages"]
    data = DataProto.from_dict({k: raw[k] for k in keys})
    data.batch["old_log_probs"] = raw["noise_old"] - 5.0
    return data


def test_non_finite_gradient_skips_the_step(tiny_model_dir):
    actor = _plain_actor(tiny_model_dir)
    data = _ppo_batch()
    data.batch["advantages"][0, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    metrics = actor.update_policy(data, rows_per_mini_batch=4)
    assert metrics["actor/num_skipped_steps"] == 1.0
    assert math.isnan(metrics["actor/grad_norm"])
    for n, p in actor.model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None


def test_lr_follows_the_schedule_once_per_update(tiny_model_dir):
    from tinyzero.workers.config import OptimConfig

    optim = OptimConfig(lr=1e-4, warmup_style="cosine", lr_warmup_steps=1, total_training_steps=4, min_lr_ratio=0.1)
    actor = _plain_actor(tiny_model_dir, optim=optim, ppo_epochs=2)  # 2 optimizer steps, one lr step per call
    lrs = [actor.update_policy(_ppo_batch(), rows_per_mini_batch=2)["actor/lr"] for _ in range(4)]
    expected = [1e-4 * cosine_lr_factor(s, 1, 4, 0.1) for s in range(4)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert actor.optimizer.state[next(iter(actor.optimizer.state))]["step"] == 4 * 2 * 2


def test_reward_model_retokenize_chat_template_and_plain(tiny_model_dir):
    """retokenize: rows with chat messages are the reward tokenizer's chat template over the messages plus
    the decoded response as the assistant turn; rows without are prompt + response text (+ eos when the
    response ended); left-padded, cut to the last max_length tokens. Reference: the tokenizer itself."""
    from transformers import AutoTokenizer

    from tinyzero.workers.reward_model import retokenize

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.chat_template
    prompts = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "Say hi"}]]
    responses = ["It is 5.", "Hello there"]
    prompt_ids = [tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"] for m in prompts]  # as RLHFDataset renders them
    resp_ids = [tok(responses[0])["input_ids"] + [tok.eos_token_id], tok(responses[1])["input_ids"]]
    p, r = max(map(len, prompt_ids)), max(map(len, resp_ids)) + 2
    ids = torch.full((2, p + r), tok.pad_token_id)
    mask = torch.zeros(2, p + r, dtype=torch.long)
    for i in range(2):  # left-padded prompts, right-padded responses (the rollout layout)
        ids[i, p - len(prompt_ids[i]):p], mask[i, p - len(prompt_ids[i]):p] = torch.tensor(prompt_ids[i]), 1
        ids[i, p:p + len(resp_ids[i])], mask[i, p:p + len(resp_ids[i])] = torch.tensor(resp_ids[i]), 1
    tensors = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, p:]}

    def expected(texts, max_length=None):
        rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, rows)) if max_length is None else min(max_length, max(map(len, rows)))
        rows = [row[-width:] for row in rows]
        out = torch.full((len(rows), width), tok.pad_token_id)
        for i, row in enumerate(rows):
            out[i, width - len(row):] = torch.tensor(row)
        return out, (torch.arange(width) >= width - torch.tensor([len(x) for x in rows])[:, None]).long()

    chat = DataProto.from_dict(tensors, non_tensors={"raw_prompt": prompts})
    got = retokenize(chat, tok, tok)
    want_ids, want_mask = expected([tok.apply_chat_template(m + [{"role": "assistant", "content": a}], tokenize=False)
                                    for m, a in zip(prompts, responses)])
    assert torch.equal(got.batch["input_ids"], want_ids) and torch.equal(got.batch["attention_mask"], want_mask)
    assert torch.equal(got.batch["position_ids"], (want_mask.cumsum(-1) - 1).clamp(min=0))

    plain = retokenize(DataProto.from_dict(tensors), tok, tok, max_length=12)
    texts = [tok.decode(prompt_ids[0], skip_special_tokens=True) + responses[0] + tok.eos_token,
             tok.decode(prompt_ids[1], skip_special_tokens=True) + responses[1]]
    want_ids, want_mask = expected(texts, max_length=12)
    assert plain.batch["input_ids"].shape[1] == 12
    assert torch.equal(plain.batch["input_ids"], want_ids) and torch.equal(plain.batch["attention_mask"], want_mask)


def test_optimizer_implementations_agree_with_a_float64_adamw():
    """optim.implementation: "auto" is the fused kernel on CPU; foreach equals the per-parameter loop bit
    for bit; fused agrees with a float64 AdamW to fp32 rounding after a few steps."""
    from tinyzero.workers.config import OptimConfig
    from tinyzero.workers.optim import build_optimizer

    def run(impl: str, dtype=torch.float32):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dtype)
        opt = build_optimizer(model.parameters(), OptimConfig(lr=1e-2, weight_decay=0.1, implementation=impl))
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        for _ in range(5):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return opt, torch.cat([p.detach().flatten() for p in model.parameters()])

    auto, got_auto = run("auto")
    assert auto.defaults["fused"] is True
    _, got_fused = run("fused")
    _, got_foreach = run("foreach")
    _, got_loop = run("for-loop")
    _, want = run("for-loop", torch.float64)
    assert torch.equal(got_foreach, got_loop)
    assert torch.equal(got_auto, got_fused)
    torch.testing.assert_close(got_fused.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_loop.double(), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="optim.implementation"):
        OptimConfig(implementation="apex")
