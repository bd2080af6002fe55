"""Packed training passes (tinyzero.workers.packing) against the unpacked path and float64 references.

Single process: packed log-probs, entropies, values and their gradients equal the unpacked
pass (1e-5, fp32) and a float64 HF reference, for GRPO groups (n=3) with unequal response
lengths and left-padded prompts of different lengths, and for n=1; the packed layout computes
each group's prompt once with position ids that restart at the prompt length.

Two gloo ranks through the workers: one PPO update (actor and critic) with remove_padding and
shared-prefix packing, including micro-batches that split a group and token-budget micro-batches,
gives the unpacked update's loss, grad norm and parameters (1e-5) and matches a float64
reference; an update that takes its old log-probs from its own forward (strictly on-policy, no
compute_log_prob pass) gives the same parameters as one fed compute_log_prob's (1e-6).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_workers_actor import _full_params, _portable, _torch
from tests.workers_helpers import critic_step, hf_response_log_probs, make_batch, reference_actor_loss

N = 3  # samples per prompt
PROMPTS = 4
LR = 1e-3
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
ENTROPY_COEFF = 0.01
KL_COEF = 0.1


def grouped_batch(prompts: int = PROMPTS, n: int = N, seed: int = 0) -> dict:
    """make_batch's left-padded prompts, each repeated n times (interleaved) with its own responses."""
    base = make_batch(prompts, seed=seed)
    p = base["prompts"].shape[1]
    r = base["responses"].shape[1]
    g = torch.Generator().manual_seed(seed + 1)
    rows = prompts * n
    ids = base["input_ids"].repeat_interleave(n, 0)
    attn = base["attention_mask"].repeat_interleave(n, 0)
    attn[:, p:] = 0
    for i in range(rows):
        attn[i, p:p + 1 + (i * 5 + i // n) % r] = 1  # unequal lengths inside a group
    ids[:, p:] = torch.randint(3, 250, (rows, r), generator=g) * attn[:, p:]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    mask = attn[:, p:].float()
    return {
        "input_ids": ids, "attention_mask": attn, "position_ids": pos, "prompts": ids[:, :p],
        "responses": ids[:, p:], "response_mask": mask,
        "advantages": torch.randn(rows, r, generator=g) * mask,
        "returns": torch.randn(rows, r, generator=g) * mask,
        "noise_old": torch.randn(rows, r, generator=g) * 0.3,
        "noise_ref": torch.randn(rows, r, generator=g) * 0.2,
        "noise_values": torch.randn(rows, r, generator=g) * 0.5,
        "noise_rollout": torch.randn(rows, r, generator=g) * 0.1,
    }


# ---------------------------------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from tinyzero.models.value import load_value_model
    from tinyzero.workers.forward import attach_log_prob_method

    torch.manual_seed(0)
    lm = attach_log_prob_method(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                                     attn_implementation="sdpa"))
    lm64 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    value = load_value_model(tiny_model_dir, dtype="fp32", attn_implementation="sdpa")
    return lm, lm64, value


@pytest.mark.parametrize("n", [N, 1])
def test_packed_log_probs_values_and_gradients_match_unpacked(models, n):
    from tinyzero.workers.forward import response_log_probs, response_values

    lm, lm64, value = models
    b = grouped_batch(n=n)
    mask = b["response_mask"].bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_lp, ref_ent = hf_response_log_probs(lm64, b, with_entropy=True)
    results = {}
    for mode in ("none", "remove_padding", "shared_prefix"):
        lm.zero_grad(set_to_none=True)
        lp, ent = response_log_probs(lm, b, 1.0, True, mode)
        ((lp * weights)[mask].sum() + ent[mask].sum()).backward()
        grads = {k: p.grad.clone() for k, p in lm.named_parameters()}
        with torch.no_grad():
            vals = response_values(value, b, mode)
        results[mode] = lp.detach(), ent.detach(), vals, grads
        torch.testing.assert_close(lp[mask].double(), ref_lp[mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(ent[mask].double(), ref_ent[mask], rtol=0, atol=1e-5)
        if mode != "none":  # padding positions are 0 when packed
            assert not lp.detach()[~mask].any() and not ent.detach()[~mask].any()
    # float64 gradient of the same objective.
    lm64.zero_grad(set_to_none=True)
    lp64, ent64 = hf_response_log_probs(lm64, b, with_entropy=True)
    ((lp64 * weights.double())[mask].sum() + ent64[mask].sum()).backward()
    base = results["none"]
    for mode in ("remove_padding", "shared_prefix"):
        lp, ent, vals, grads = results[mode]
        torch.testing.assert_close(lp[mask], base[0][mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(vals[mask], base[2][mask], rtol=0, atol=1e-5)
        for name, p64 in lm64.named_parameters():
            torch.testing.assert_close(grads[name], base[3][name], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(grads[name].double(), p64.grad, rtol=0, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["remove_padding", "shared_prefix"])
def test_segment_attention_matches_the_dense_mask(models, mode, monkeypatch):
    """prepare_attention switches SDPA models to packed_sdpa_attention: per-segment attention over
    gathered keys gives the dense-mask pass's log-probs, entropies, values and gradients (1e-5), and
    unpacked calls (no blocks) are HF's SDPA unchanged."""
    import copy

    from tinyzero.workers import packing as packing_module
    from tinyzero.workers.forward import response_log_probs, response_values
    from tinyzero.workers.packing import PACKED_ATTENTION, prepare_attention

    monkeypatch.setattr(packing_module, "BLOCKS_WORTH", float("inf"))  # the blocks however little they save
    calls = []
    blocks_attention = packing_module.packed_sdpa_attention
    monkeypatch.setattr(packing_module, "packed_sdpa_attention",
                        lambda *a, **k: calls.append(k.get("attention_blocks") is not None) or blocks_attention(*a, **k))
    lm, _, value = models
    seg_lm, seg_value = copy.deepcopy(lm), copy.deepcopy(value)
    for m in (seg_lm, seg_value):
        prepare_attention(m, mode)  # registers the patched function
        assert m.config._attn_implementation == PACKED_ATTENTION
    b = grouped_batch()
    b["attention_mask"][1, -b["responses"].shape[1]:] = 0  # an empty response too
    b["response_mask"][1] = 0
    mask = b["response_mask"].bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4))
    out = {}
    for name, model, critic, packing in (("dense", lm, value, mode), ("segments", seg_lm, seg_value, mode),
                                         ("unpacked", seg_lm, seg_value, "none")):
        model.zero_grad(set_to_none=True)
        lp, ent = response_log_probs(model, b, 1.0, True, packing)
        ((lp * weights)[mask].sum() + ent[mask].sum()).backward()
        with torch.no_grad():
            vals = response_values(critic, b, packing)
        out[name] = lp.detach(), ent.detach(), vals, {k: p.grad.clone() for k, p in model.named_parameters()}
    for name in ("segments", "unpacked"):
        for got, want in zip(out[name][:3], out["dense"][:3]):
            torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)
        for k, g in out[name][3].items():
            torch.testing.assert_close(g, out["dense"][3][k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert not out["segments"][0][~mask].any()
    assert any(calls) and not all(calls)  # blocks when packed, HF's SDPA unpacked
    monkeypatch.undo()
    packing_module.register_packed_attention()  # the real function back in HF's registry


def test_packed_sdpa_keeps_the_dense_mask_where_blocks_save_little(models, monkeypatch):
    import copy

    from tinyzero.workers import packing

    lm = copy.deepcopy(models[0])
    packing.prepare_attention(lm, "shared_prefix")
    b = grouped_batch()
    packed = packing.pack(b["input_ids"], b["attention_mask"], b["position_ids"], b["responses"].shape[1],
                          share_prefix=True)
    rows, length = packed.segments.shape
    share = sum(blk.mask.numel() for blk in packing.attention_blocks(packed.segments, packed.sees)) / (
        rows * length * length)
    for worth, blocks in ((share * 0.99, False), (share, True)):
        monkeypatch.setattr(packing, "BLOCKS_WORTH", worth)
        packed.blocks = None
        mask = packing.model_mask(packed, lm, torch.float32)
        assert (packed.blocks is not None) == blocks
        assert mask.shape == (rows, 1, length, length)
        if not blocks:
            assert torch.equal(mask, packed.dense_mask())


def test_attention_blocks_pair_each_response_with_its_prompt():
    from tinyzero.workers.packing import attention_blocks, pack

    b = grouped_batch(prompts=2, n=2)
    r = b["responses"].shape[1]
    packed = pack(b["input_ids"], b["attention_mask"], b["position_ids"], r, share_prefix=True)
    alone, seeing = attention_blocks(packed.segments, packed.sees)
    flat_seg = packed.segments.reshape(-1)
    assert alone.q_index.shape[0] == 2 and seeing.q_index.shape[0] == 4  # 2 prompts, 4 responses
    # every real token is a query exactly once
    covered = torch.cat([alone.out_index, seeing.out_index]).sort().values
    assert torch.equal(covered, (flat_seg >= 0).nonzero().squeeze(-1))
    for i in range(4):
        q = seeing.q_index[i][seeing.q_valid[i]]
        own = flat_seg[q].unique()
        assert len(own) == 1
        keys = seeing.kv_index[i][seeing.mask[i, 0].any(0)]
        prompt = packed.sees.reshape(-1)[q[0]]
        assert set(flat_seg[keys].tolist()) == {int(own), int(prompt)}
        # causal inside the response: query slot t sees its first t + 1 own tokens
        lp = seeing.kv_index.shape[1] - seeing.q_index.shape[1]
        own_seen = seeing.mask[i, 0, :, lp:].sum(-1)[seeing.q_valid[i]]
        assert torch.equal(own_seen, torch.arange(1, len(q) + 1))


def test_packed_sdpa_keeps_grouped_kv_heads_on_cpu():
    """With a mask on CPU, packed_sdpa_attention hands SDPA the kv heads as they are: the same output and
    gradients as HF's SDPA (which repeats them, float64 reference), and backward keeps no repeated k or v."""
    import types

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tinyzero.workers.packing import packed_sdpa_attention

    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, length, d = 2, 6, 2, 9, 8
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    mask = torch.ones(length, length, dtype=torch.bool).tril().expand(b, 1, length, length).clone()
    mask[1, :, :, :3] = False  # row 1 starts with padding ...
    mask[1, :, :3, 0] = True  # ... whose queries see one key
    qkv = [torch.randn(b, h, length, d, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)]
    gy = torch.randn(b, length, heads, d, generator=g, dtype=torch.float64)
    results = []
    for fn, dtype in ((sdpa_attention_forward, torch.float64), (packed_sdpa_attention, torch.float32)):
        inputs = [t.to(dtype).clone().requires_grad_() for t in qkv]
        shapes: list[tuple] = []

        def keep(t, shapes=shapes):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out, _ = fn(module, *inputs, mask, scaling=d ** -0.5)
        out.backward(gy.to(dtype))
        results.append((out, *[t.grad for t in inputs], shapes))
    for ref, got in zip(results[0][:4], results[1][:4]):
        assert (got.double() - ref).abs().max().item() < 1e-5
    full, grouped = (b, heads, length, d), (b, kv_heads, length, d)
    assert results[0][4].count(full) == 4 and results[0][4].count(grouped) == 0  # q, repeated k and v, out
    assert results[1][4].count(full) == 2 and results[1][4].count(grouped) == 2  # q, out; k and v as they are


def test_long_groups_cut_for_dense_masks_stay_exact(models, monkeypatch):
    from tinyzero.workers.forward import response_log_probs
    from tinyzero.workers.packing import pack

    lm = models[0]
    b = grouped_batch()
    r = b["responses"].shape[1]
    mask = b["response_mask"].bool()
    whole = pack(b["input_ids"], b["attention_mask"], b["position_ids"], r, share_prefix=True)
    cut = pack(b["input_ids"], b["attention_mask"], b["position_ids"], r, share_prefix=True, max_unit_tokens=10)
    assert int((cut.segments >= 0).sum()) > int((whole.segments >= 0).sum())  # prompts repeated
    with torch.no_grad():
        base = response_log_probs(lm, b, 1.0, False, "none")[0]
        monkeypatch.setattr("tinyzero.workers.forward.DENSE_ROW_TOKENS", 10)
        got = response_log_probs(lm, b, 1.0, False, "shared_prefix")[0]
    torch.testing.assert_close(got[mask], base[mask], rtol=0, atol=1e-5)


def test_eager_attention_takes_the_additive_mask(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from tinyzero.workers.forward import attach_log_prob_method, response_log_probs

    b = grouped_batch()
    mask = b["response_mask"].bool()
    out = {}
    for impl, mode in (("sdpa", "none"), ("eager", "shared_prefix")):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=impl)
        with torch.no_grad():
            out[impl] = response_log_probs(attach_log_prob_method(model), b, 1.0, False, mode)[0]
    torch.testing.assert_close(out["eager"][mask], out["sdpa"][mask], rtol=0, atol=1e-5)


def test_shared_prefix_layout_computes_each_prompt_once():
    from tinyzero.workers.packing import pack, prompt_groups

    b = grouped_batch()
    r = b["responses"].shape[1]
    p = b["input_ids"].shape[1] - r
    groups = prompt_groups(b["input_ids"], b["attention_mask"], b["position_ids"], r)
    assert groups == [list(range(g * N, g * N + N)) for g in range(PROMPTS)]
    packed = pack(b["input_ids"], b["attention_mask"], b["position_ids"], r, share_prefix=True)
    am = b["attention_mask"]
    prompt_tokens = int(am[::N, :p].sum())
    real = int((packed.segments >= 0).sum())
    assert real == prompt_tokens + int(am[:, p:].sum())  # the prompt once per group, every response
    plain = pack(b["input_ids"], b["attention_mask"], b["position_ids"], r, share_prefix=False)
    assert plain.input_ids.numel() >= int(am.sum()) > real
    # Response token 0 is predicted from the prompt's last token, at position prompt_len - 1, and every
    # response's positions restart at the prompt length.
    flat_pos = packed.position_ids.reshape(-1)
    first = packed.hidden_index[: int(b["response_mask"][0].sum())][0]
    assert int(flat_pos[first]) == int(am[0, :p].sum()) - 1
    flat_ids = packed.input_ids.reshape(-1)
    for i in range(N):
        k = int(am[i, p:].sum())
        idx = packed.hidden_index[int(am[:i, p:].sum()):][:k]
        assert flat_ids[idx[1:]].tolist() == b["responses"][i, :k - 1].tolist()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_matches_dense_mask():
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    from tinyzero.workers.packing import pack

    b = grouped_batch()
    r = b["responses"].shape[1]
    packed = pack(b["input_ids"], b["attention_mask"], b["position_ids"], r, share_prefix=True)
    rows, length = packed.segments.shape
    dense = packed.dense_mask()
    assert torch.equal(create_mask(packed.mask_mod(), rows, None, length, length, device="cpu"), dense)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, 2, length, 8, generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=packed.block_mask()), ref, rtol=0, atol=1e-5)


def test_token_budget_counts_packed_tokens_and_keeps_groups():
    from tinyzero.protocol import DataProto
    from tinyzero.workers.batching import split_dynamic

    b = grouped_batch()
    data = DataProto.from_dict({k: b[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")})
    r = b["responses"].shape[1]
    p = b["input_ids"].shape[1] - r
    group_tokens = [int(b["attention_mask"][g * N, :p].sum() + b["attention_mask"][g * N:g * N + N, p:].sum())
                    for g in range(PROMPTS)]
    budget = max(group_tokens)
    micros, parts = split_dynamic(data, budget, share_prefix=True)
    for rows in parts:
        groups = {i // N for i in rows}
        assert sorted(rows) == [g * N + k for g in sorted(groups) for k in range(N)]  # whole groups
        assert sum(group_tokens[g] for g in groups) <= budget
    # Unpacked counting needs more micro-batches for the same budget.
    assert len(split_dynamic(data, budget)[0]) > len(micros)


# ---------------------------------------------------------------------------------------------- two ranks
def _configs(model_dir: str, packing: str = "none", micro: int | None = None, dynamic: bool = False,
             max_tokens: int = 64):
    from tinyzero.models.config import ModelConfig
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.workers.config import ActorConfig, ActorRolloutRefConfig, CriticConfig, OptimConfig

    flags = {"use_remove_padding": packing == "remove_padding", "use_shared_prefix": packing == "shared_prefix"}
    optim = OptimConfig(lr=LR, weight_decay=0.01, eps=1e-6)
    actor = ActorConfig(ppo_mini_batch_size=PROMPTS, ppo_micro_batch_size_per_gpu=micro, use_dynamic_bsz=dynamic,
                        ppo_max_token_len_per_gpu=max_tokens, grad_clip=1e4, entropy_coeff=ENTROPY_COEFF,
                        use_kl_loss=True, kl_loss_coef=KL_COEF, kl_loss_type="low_var_kl", optim=optim, **CLIP)
    rollout = RolloutConfig(n=N, prompt_length=7, response_length=6, log_prob_micro_batch_size_per_gpu=micro or 8,
                            log_prob_use_dynamic_bsz=dynamic, log_prob_max_token_len_per_gpu=max_tokens)
    arr = ActorRolloutRefConfig(model=ModelConfig(path=model_dir, **flags), actor=actor, rollout=rollout)
    critic = CriticConfig(model=ModelConfig(path=model_dir, enable_gradient_checkpointing=False, **flags),
                          optim=OptimConfig(lr=LR, eps=1e-6), rollout_n=N, ppo_mini_batch_size=PROMPTS,
                          ppo_micro_batch_size_per_gpu=micro, use_dynamic_bsz=dynamic,
                          ppo_max_token_len_per_gpu=max_tokens, forward_max_token_len_per_gpu=max_tokens,
                          grad_clip=1e4, cliprange_value=0.2)
    return arr, critic


def packing_rank_fn(model_dir: str, variants: list[dict]):
    """One actor (+ critic) update per variant on this rank's chunk; rank 0 returns the results."""
    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.protocol import DataProto
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker

    init_distributed()
    torch.set_num_threads(1)
    raw = grouped_batch()
    keys = ["input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask", "advantages",
            "returns"]
    full = DataProto.from_dict({k: raw[k] for k in keys}, meta_info={"temperature": 1.0})
    results = []
    for v in variants:
        set_seed(0)
        arr_cfg, critic_cfg = _configs(model_dir, **{k: x for k, x in v.items() if k not in ("source", "critic")})
        actor = ActorRolloutRefWorker(arr_cfg, "actor")
        actor.init_model()
        ref_worker = ActorRolloutRefWorker(arr_cfg, "ref")
        ref_worker.init_model()
        local = full.chunk(actor.world_size)[actor.rank]
        rows = torch.arange(len(full)).chunk(actor.world_size)[actor.rank]
        out = actor.compute_log_prob(local)
        ref = ref_worker.compute_ref_log_prob(local)
        local.batch["ref_log_prob"] = ref.batch["ref_log_prob"] + raw["noise_ref"][rows]
        source = v.get("source", "noisy")
        if source == "noisy":
            local.batch["old_log_probs"] = out.batch["old_log_probs"] + raw["noise_old"][rows]
        else:  # the sampler's log-probs, a little off the trainer's
            local.batch["rollout_log_probs"] = out.batch["old_log_probs"] + raw["noise_rollout"][rows]
        if source == "actor":
            local.batch["old_log_probs"] = out.batch["old_log_probs"]
        elif source == "update":
            local.meta_info["old_log_probs_source"] = "update"
        before = _full_params(actor.actor.model)
        metrics = actor.update_actor(local).meta_info["metrics"]
        res = {"variant": v, "metrics": metrics, "params": _full_params(actor.actor.model), "before": before,
               "log_probs": out.batch["old_log_probs"], "rows": rows}
        if v.get("critic"):
            res.update(critic_step(critic_cfg, local, raw["noise_values"][rows], _full_params))
        results.append(res)
    return _portable(results) if int(os.environ["RANK"]) == 0 else None


def _reference(model_dir: str):
    """float64: pg loss, grad norm and parameters after one AdamW step on the whole grouped batch."""
    from transformers import AutoModelForCausalLM

    raw = grouped_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        lp = hf_response_log_probs(model, raw)
    batch = dict(raw, old_log_probs=lp + raw["noise_old"], ref_log_prob=lp + raw["noise_ref"])
    loss, pg_loss = reference_actor_loss(model, batch, CLIP["clip_ratio_low"], CLIP["clip_ratio_high"],
                                         CLIP["clip_ratio_c"], ENTROPY_COEFF, KL_COEF)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.01).step()
    return float(pg_loss.detach()), float(grad_norm), {n: p.detach().float() for n, p in model.named_parameters()}


def _assert_params_close(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model_dir):
    variants = [{"critic": True}, {"packing": "remove_padding"},
                {"packing": "shared_prefix", "critic": True},
                {"packing": "shared_prefix", "micro": 2},  # micro-batches of 2 rows split the groups of 3
                {"packing": "shared_prefix", "dynamic": True, "max_tokens": 30, "critic": True},
                {"source": "actor"}, {"source": "update"}, {"source": "update", "packing": "shared_prefix"}]
    return _torch(run_distributed(packing_rank_fn, 2, tiny_model_dir, variants, timeout=600)[0])


@pytest.mark.slow
def test_packed_update_matches_unpacked_and_float64(two_rank_runs, tiny_model_dir):
    ref_pg, ref_norm, ref_params = _reference(tiny_model_dir)
    noisy = [r for r in two_rank_runs if "source" not in r["variant"]]
    base = noisy[0]
    for res in noisy:
        m = res["metrics"]
        assert m["actor/grad_norm"] == pytest.approx(ref_norm, rel=1e-4), res["variant"]
        assert m["actor/pg_loss"] == pytest.approx(ref_pg, rel=1e-4, abs=1e-6), res["variant"]
        assert max(float((res["params"][n] - res["before"][n]).abs().max()) for n in res["params"]) > 0.5 * LR
        _assert_params_close(res["params"], ref_params, atol=1e-5)
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy",
                    "actor/grad_norm"):
            assert m[key] == pytest.approx(base["metrics"][key], rel=1e-5, abs=1e-7), (key, res["variant"])
        _assert_params_close(res["params"], base["params"], atol=1e-5)
        mask = grouped_batch()["response_mask"][res["rows"]].bool()
        torch.testing.assert_close(res["log_probs"][mask], base["log_probs"][mask], rtol=0, atol=1e-5)
        if "critic_metrics" in res:
            torch.testing.assert_close(res["values"][mask], base["values"][mask], rtol=0, atol=1e-5)
            for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"):
                assert res["critic_metrics"][key] == pytest.approx(base["critic_metrics"][key], rel=1e-5,
                                                                   abs=1e-7), (key, res["variant"])
            _assert_params_close(res["critic_params"], base["critic_params"], atol=1e-5)


def test_on_policy_update_without_old_log_prob_pass_matches(two_rank_runs, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from tinyzero.algorithms import rollout_mismatch_metrics

    raw = grouped_batch()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    with torch.no_grad():
        lp = hf_response_log_probs(model, raw)
    # The pass that measures the sampler/trainer gap does not run: the update measures it instead.
    expected = rollout_mismatch_metrics(lp, lp + raw["noise_rollout"], raw["response_mask"])
    by_source = [r for r in two_rank_runs if "source" in r["variant"]]
    with_pass, *skipped = by_source
    assert not any(k.startswith("training/rollout") for k in with_pass["metrics"])
    for res in skipped:
        _assert_params_close(res["params"], with_pass["params"], atol=1e-6)
        assert res["metrics"]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)  # the ratio is exactly 1
        assert res["metrics"]["actor/pg_clipfrac"] == 0.0
        assert res["metrics"]["actor/entropy"] == pytest.approx(with_pass["metrics"]["actor/entropy"], rel=1e-5)
        for key, value in expected.items():
            assert res["metrics"][key] == pytest.approx(float(value), rel=1e-4, abs=1e-6), key


# ---------------------------------------------------------------------------------------------- trainer side
@pytest.mark.parametrize("epochs,mini,kl_in_reward,bypass,expected", [
    (1, 8, False, False, "update"), (2, 8, False, False, "actor"), (1, 4, False, False, "actor"),
    (1, 8, True, False, "actor"), (2, 4, False, True, "rollout")])
def test_old_log_prob_source(epochs, mini, kl_in_reward, bypass, expected):
    from types import SimpleNamespace

    from tinyzero.config import Config
    from tinyzero.trainer.ppo import PPOTrainer

    cfg = Config()
    cfg.data.train_batch_size = 8
    cfg.actor_rollout_ref.actor.ppo_epochs = epochs
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = mini
    cfg.algorithm.use_kl_in_reward = kl_in_reward
    cfg.actor_rollout_ref.rollout.use_rollout_log_probs = bypass
    assert PPOTrainer.old_log_prob_source(SimpleNamespace(config=cfg)) == expected


def test_balance_batch_moves_groups_whole():
    from tinyzero.protocol import DataProto
    from tinyzero.trainer.balance import balance_batch

    b = grouped_batch(prompts=4)
    uid = torch.arange(len(b["input_ids"])) // N
    data = DataProto.from_dict({"attention_mask": b["attention_mask"], "uid": uid})
    metrics = {}
    balance_batch(data, 2, metrics, group_size=N)
    chunks = data.batch["uid"].view(2, -1)
    assert all(len(set(c.tolist())) == len(c) // N for c in chunks)  # every group on one rank
    assert sorted(data.batch["uid"].tolist()) == sorted(uid.tolist())
    assert metrics["training/seqlen_balance_max_min_ratio"] >= 1.0


def trainer_rank_fn(model_dir: str, data_dir: str, out_dir: str):
    """One GRPO step through build_ppo_trainer + fit, with and without the old_log_prob pass."""
    from tinyzero.cli import load_preset
    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.trainer.builder import build_ppo_trainer

    init_distributed()
    torch.set_num_threads(1)
    sources = {}
    for source in ("update", "actor"):
        cfg = load_preset("demo_cpu")
        cfg.data.train_files, cfg.data.val_files = [f"{data_dir}/train.parquet"], []
        cfg.data.train_batch_size = 4
        cfg.actor_rollout_ref.model.path = model_dir
        cfg.actor_rollout_ref.rollout.n = 4
        cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 4  # one optimizer step: strictly on-policy
        cfg.actor_rollout_ref.actor.entropy_coeff = 0.01  # a gradient even if a random model's rewards tie
        t = cfg.trainer
        t.default_local_dir = f"{out_dir}/{source}"
        t.total_training_steps, t.val_before_train, t.plot, t.progress_bar = 1, False, False, False
        t.resume_mode, t.export_hf = "disable", True
        set_seed(0)
        trainer = build_ppo_trainer(cfg)
        chosen = trainer.old_log_prob_source()
        if source == "actor":
            trainer.old_log_prob_source = lambda: "actor"  # force the separate pass
        metrics = trainer.fit()
        trainer.close()
        sources[source] = (chosen, {k: v for k, v in metrics.items()
                                    if k.startswith(("actor/", "timing_s/", "training/rollout", "rollout_corr/"))})
    return sources


@pytest.mark.slow
def test_trainer_skips_old_log_prob_pass_with_same_parameters(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from tinyzero.demo import build_data

    build_data(str(tmp_path / "data"))
    out = run_distributed(trainer_rank_fn, 2, tiny_model_dir, str(tmp_path / "data"), str(tmp_path), timeout=600)[0]
    assert out["update"][0] == "update"  # the trainer chose to skip by itself
    skipped, with_pass = out["update"][1], out["actor"][1]
    assert "timing_s/old_log_prob" not in skipped and "timing_s/old_log_prob" in with_pass
    assert "timing_s/weight_sync" in skipped and skipped["timing_s/weight_sync"] >= 0.0
    assert skipped["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
    assert skipped["actor/grad_norm"] == pytest.approx(with_pass["actor/grad_norm"], rel=1e-5)
    assert skipped["actor/entropy"] == pytest.approx(with_pass["actor/entropy"], rel=1e-5)
    # The sampler/trainer gap: measured by the update when skipping, by the data metrics otherwise.
    for key in ("training/rollout_probs_diff_max", "training/rollout_log_probs_diff_mean", "rollout_corr/kl"):
        assert skipped[key] == pytest.approx(with_pass[key], rel=1e-3, abs=1e-6), key
    a = load_file(str(tmp_path / "update" / "hf_model" / "model.safetensors"))
    b = load_file(str(tmp_path / "actor" / "hf_model" / "model.safetensors"))
    init = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert a.keys() == b.keys()
    assert max(float((a[n] - init[n]).abs().max()) for n in a) > 1e-4  # the step moved the weights
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
