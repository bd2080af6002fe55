"""Ulysses sequence parallelism (tinyzero.models.ulysses) on 2 gloo ranks, float64.

Against the project's plain one-process path (tinyzero.workers.forward with the same packing) and
a plain HF model (full logits, log_softmax), for padded batches (left-padded
prompts, right-padded responses, odd length so the sp padding is used) and packed ones
("remove_padding", "shared_prefix" 4-D masks), with 2 kv heads (split over the ranks) and 1 kv head
(repeated to 2) on the tiny Qwen2, and on random tiny Llama and Qwen3 (q/k norms) models:
- response log-probs and entropy at sp=2 equal both within 1e-10;
- the gradients of a token-mean loss, summed over the sp group, equal the one-process path's within
  1e-10 (the definition of the convention in tinyzero.models.ulysses); under FSDP2 sharded over the
  sp ranks, the loss scaled by sp gives the one-process gradients; also with activation checkpointing
  (attention recomputed in backward), and through `sp_model_forward` (the critic / reward path).
Gradients are compared with the one-process path of the SAME packing: shared_prefix sums the n
responses' gradients into one prompt before HF's RMSNorm rounds them to float32 (Qwen2RMSNorm computes
in float32 even in a float64 model), so shared_prefix and unpacked gradients differ by ~1e-7 relative.
Plus the memory point: peak live tensor bytes of a long-sequence forward + backward at sp=2 are well
below sp=1's (bench/long_context.py measures 8k tokens; here 1k keep the test short).
Budget: about 40-60 s (one 2-rank spawn) on a loaded 2-core machine.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.workers_helpers import hf_response_log_probs, make_batch

TOL = 1e-10


def _grouped_batch(seed: int) -> dict:
    """make_batch rows where rows 2k and 2k+1 share their prompt (a GRPO group of 2), length 13."""
    b = make_batch(num_rows=6, prompt_len=7, response_len=6, seed=seed)
    ids, attn = b["input_ids"].clone(), b["attention_mask"].clone()
    ids[1::2, :7], attn[1::2, :7] = ids[0::2, :7], attn[0::2, :7]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return dict(b, input_ids=ids, attention_mask=attn, position_ids=pos, responses=ids[:, 7:],
                response_mask=attn[:, 7:].double())


def _token_mean_loss(log_probs, entropy, batch):
    mask = batch["response_mask"]
    loss_mat = -log_probs * batch["advantages"].double() - 0.01 * entropy  # (batch, R)
    return (loss_mat * mask).sum() / mask.sum()


def _other_family(name: str):
    """A random float64 Llama or Qwen3 (q/k norms) of the tiny size, identical on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[name]
    config = config_cls(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                        attn_implementation="sdpa")
    torch.manual_seed(7)
    return model_cls(config).double()


def _equivalence(hf, group, full: bool = True) -> dict:
    """max |sp=2 - sp=1| of log-probs, entropy and summed gradients, and max |sp=2 - HF| of log-probs and
    entropy, per packing mode. sp=1 is the project's plain path with the same packing. `full` adds the
    FSDP2, edge-batch, checkpointing and gathered-forward checks."""
    import copy

    from tinyzero.models.ulysses import attach_sp_log_prob_method
    from tinyzero.workers.forward import attach_log_prob_method, response_log_probs
    from tinyzero.workers.packing import prepare_attention

    ref = attach_log_prob_method(copy.deepcopy(hf))
    model = attach_sp_log_prob_method(copy.deepcopy(hf), group)
    batch = _grouped_batch(seed=1)
    with torch.no_grad():
        lp_hf, ent_hf = hf_response_log_probs(hf, batch, temperature=0.7, with_entropy=True)
    mask = batch["response_mask"].bool()
    with torch.no_grad():  # without a group (generation, sp=1) "ulysses_sdpa" is HF's sdpa
        plain = [m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits for m in (hf, model)]
    out = {"no_group": (plain[0] - plain[1]).abs().max().item()}
    for packing in ("none", "remove_padding", "shared_prefix"):
        results = []
        for m in (ref, model):
            prepare_attention(m, packing)
            m.zero_grad()
            lp, ent = response_log_probs(m, batch, 0.7, True, packing)
            _token_mean_loss(lp, ent, batch).backward()
            results.append((lp.detach(), ent.detach()))
        (lp_ref, ent_ref), (lp, ent) = results
        worst = _summed_grad_diff(model, ref, group)
        out[packing] = dict(log_probs=(lp - lp_ref)[mask].abs().max().item(),
                            entropy=(ent - ent_ref)[mask].abs().max().item(), grads=worst,
                            log_probs_hf=(lp - lp_hf)[mask].abs().max().item(),
                            entropy_hf=(ent - ent_hf)[mask].abs().max().item(),
                            attn=model.config._attn_implementation)
    if not full:
        return out
    out["fsdp"] = _fsdp_grads(hf, ref, batch, group)  # ref holds the shared_prefix gradients here
    out["edge_batches"] = _edge_batches(ref, model, group)
    out["checkpointing"] = _checkpointed_grads(ref, model, batch, group)
    out["model_forward"] = _gathered_forward(hf, model, batch, group)
    return out


def _summed_grad_diff(model, ref, group) -> float:
    import torch.distributed as dist

    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)  # partial gradients: their sum over the sp group is the gradient
        worst = max(worst, (g - q.grad).abs().max().item())
    return worst


def _fsdp_grads(hf, ref, batch, group) -> float:
    """FSDP2 sharded over the sp ranks (veRL's layout): it averages the partial gradients over its 2 ranks,
    so the loss scaled by sp gives the one-process gradient."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tinyzero.models.ulysses import attach_sp_log_prob_method
    from tinyzero.workers.forward import response_log_probs
    from tinyzero.workers.packing import prepare_attention

    model = copy.deepcopy(hf)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    attach_sp_log_prob_method(model, group)
    prepare_attention(model, "shared_prefix")
    lp, ent = response_log_probs(model, batch, 0.7, True, "shared_prefix")
    (_token_mean_loss(lp, ent, batch) * dist.get_world_size(group)).backward()
    return max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


def _right_padded_batch() -> dict:
    """Rows whose real tokens come first (no left padding): split_for_sp needs no mask (plain causal)."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 250, (2, 13), generator=g)
    attn = torch.ones(2, 13, dtype=torch.long)
    attn[1, 10:] = 0
    ids = ids * attn
    return {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, 7:], "response_mask": attn[:, 7:].double(),
            "advantages": torch.randn(2, 6, generator=g)}


def _edge_batches(ref, model, group) -> float:
    """(a) every response token predicted from rank 1's slice: rank 0 gathers an empty piece and still
    takes part in the backward's all-to-alls; (b) no left padding: no mask at all."""
    from tinyzero.models.ulysses import split_for_sp
    from tinyzero.workers.forward import response_log_probs

    right = _right_padded_batch()
    assert split_for_sp(right["input_ids"], right["attention_mask"], right["position_ids"], group).attention_mask is None
    worst = 0.0
    for batch in (make_batch(num_rows=2, prompt_len=12, response_len=2, seed=4), right):
        outs = []
        for m in (ref, model):
            m.zero_grad()
            lp, ent = response_log_probs(m, batch, 1.0, True)
            _token_mean_loss(lp, ent, batch).backward()
            outs.append(lp.detach())
        real = batch["response_mask"].bool()
        worst = max(worst, (outs[0] - outs[1])[real].abs().max().item(), _summed_grad_diff(model, ref, group))
    return worst


def _checkpointed_grads(ref, model, batch, group) -> float:
    """Activation checkpointing recomputes attention in backward: the group must still reach it."""
    from tinyzero.workers.forward import response_log_probs

    model.gradient_checkpointing_enable()
    model.train()
    for m in (ref, model):
        m.zero_grad()
        _token_mean_loss(*response_log_probs(m, batch, 0.7, True), batch).backward()
    model.gradient_checkpointing_disable()
    return _summed_grad_diff(model, ref, group)


def _gathered_forward(hf, model, batch, group) -> dict:
    """sp_model_forward (the critic / reward-model path): gathered logits and summed gradients vs HF."""
    from tinyzero.models.ulysses import sp_model_forward

    inputs = [batch[k] for k in ("input_ids", "attention_mask", "position_ids")]
    weights = torch.randn(batch["input_ids"].shape + (hf.config.vocab_size,), dtype=torch.float64,
                          generator=torch.Generator().manual_seed(5)) * batch["attention_mask"][..., None]
    outs = []
    for m in (hf, model):
        m.zero_grad()
        logits = m(*inputs).logits if m is hf else sp_model_forward(m, *inputs, group)
        (logits * weights).sum().backward()
        outs.append(logits.detach())
    real = batch["attention_mask"].bool()
    return dict(logits=(outs[0] - outs[1])[real].abs().max().item(), grads=_summed_grad_diff(model, hf, group))


def _rank_main(model_dirs: dict, mem_seq: int) -> dict:
    import torch.distributed as dist

    from bench.long_context import peak_bytes

    torch.manual_seed(0)
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    from transformers import AutoModelForCausalLM

    out = {name: _equivalence(AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa",
                                                                   dtype=torch.float64), group)
           for name, path in model_dirs.items()}
    out.update({name: _equivalence(_other_family(name), group, full=False) for name in ("llama", "qwen3")})
    out["memory"] = {sp: peak_bytes(model_dirs["kv2"], mem_seq, group if sp == 2 else None) for sp in (1, 2)}
    out["errors"] = _errors(group)
    return out


@pytest.fixture(scope="module")
def sp_results(tiny_model_dir, tmp_path_factory):
    from tinyzero.models.tiny import build_tiny_model

    kv1 = build_tiny_model(str(tmp_path_factory.mktemp("tiny_kv1")), seed=3, num_kv_heads=1)
    return run_distributed(_rank_main, 2, {"kv2": tiny_model_dir, "kv1": kv1}, 1024, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["kv2", "kv1", "llama", "qwen3"])
@pytest.mark.parametrize("packing", ["none", "remove_padding", "shared_prefix"])
def test_sp2_matches_single_process(sp_results, model, packing):
    for rank, res in enumerate(sp_results):
        r = res[model][packing]
        assert r["attn"] == "ulysses_sdpa", f"rank {rank}: packing switched the attention to {r['attn']}"
        assert r["log_probs"] < TOL and r["entropy"] < TOL, f"rank {rank} {model} {packing}: {r}"
        assert r["log_probs_hf"] < TOL and r["entropy_hf"] < TOL, f"rank {rank} {model} {packing}: {r}"
        assert r["grads"] < TOL, f"rank {rank} {model} {packing}: summed gradients differ by {r['grads']}"


@pytest.mark.parametrize("model", ["kv2", "kv1"])
def test_sp2_with_fsdp_checkpointing_and_gathered_forward(sp_results, model):
    for rank, res in enumerate(sp_results):
        r = res[model]
        assert r["checkpointing"] < TOL, f"rank {rank}: gradients with activation checkpointing differ"
        assert r["edge_batches"] < TOL, f"rank {rank}: {r['edge_batches']}"
        assert r["fsdp"] < TOL, f"rank {rank}: FSDP2 gradients (loss x sp) differ by {r['fsdp']}"
        assert r["model_forward"]["logits"] < TOL and r["model_forward"]["grads"] < TOL, (rank, r["model_forward"])


def test_live_tensor_bytes_counts_alive_storages():
    from bench.long_context import LiveTensorBytes

    with LiveTensorBytes() as mem:
        a = torch.empty(1 << 20)  # 4 MiB
        view = a[:10]  # same storage: not counted again
        b = torch.ones(1 << 18, dtype=torch.float64)  # 2 MiB
        del a, view
        c = b + 1  # 2 MiB more, peak 8 MiB was reached before
        del b, c
    assert mem.peak == (4 << 20) + (2 << 20)
    assert mem.live == 0


def test_ulysses_attention_without_group_is_sdpa(sp_results):
    assert all(res[m]["no_group"] == 0.0 for res in sp_results for m in ("kv2", "kv1"))


def test_sp2_peak_memory_well_below_sp1(sp_results):
    """Live tensor bytes (deterministic byte counting, not timing) of forward + backward."""
    for rank, res in enumerate(sp_results):
        one, two = res["memory"][1], res["memory"][2]
        assert two < 0.7 * one, f"rank {rank}: peak at sp=2 {two} B is not well below sp=1 {one} B"


def _errors(group) -> list[str]:
    """The messages of three bad calls (raised before any collective, so every rank raises alike)."""
    from tinyzero.models.ulysses import split_for_sp, ulysses_attention

    errors = []
    q = torch.randn(1, 3, 4, 8)  # 3 heads: not divisible by sp=2
    try:
        ulysses_attention(torch.nn.Module(), q, q[:, :1], q[:, :1], None, sp_group=group)
    except ValueError as e:
        errors.append(str(e))
    q = torch.randn(1, 4, 4, 8)
    try:  # a local-size mask (what HF would build from a local 2-D mask)
        ulysses_attention(torch.nn.Module(), q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool), sp_group=group)
    except ValueError as e:
        errors.append(str(e))
    try:
        split_for_sp(torch.zeros(1, 4, dtype=torch.long), None, torch.zeros(3, 1, 4, dtype=torch.long), group)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_bad_layouts_name_the_fix(sp_results):
    errors = sp_results[0]["errors"]
    assert len(errors) == 3, errors
    assert "ulysses_sequence_parallel_size=2 must divide" in errors[0]
    assert "full-sequence mask" in errors[1] and "split_for_sp" in errors[1]
    assert "position_ids" in errors[2]
