"""Tensor parallelism on gloo ranks against the untouched float64 model on one process.

- vocab_parallel_log_probs at tp=2 (an uneven vocabulary split 19 / 18, token chunks smaller than
  the batch): log-probs, entropy and the gradients w.r.t. hidden and the weight shard equal a plain
  float64 log_softmax reference within 1e-10 (float64, torch path) and 2e-5 (float32, torch path and
  the Triton kernels under TRITON_INTERPRET=1); the DTensor dispatch of linear_log_probs
  (sequence-sharded hidden, Shard(0) weight) within 1e-10.
- apply_tensor_parallel at tp=2 on the tiny Qwen2 (tied embeddings, vocabulary 259 split 130 / 129),
  a tiny Llama (untied, attention bias), a tiny Qwen3 (q_norm / k_norm, tied) and the tiny Qwen2
  value model: response log-probs and entropy through the workers' own code (plain, packed,
  shared-prefix), values (plain, packed), the full logits and the clipped gradient norm within
  1e-10, every parameter after one clipped AdamW step within 1e-8; per-rank parameter counts are
  exactly the sharded share plus the replicated norms, biases and scalar head.
- tp=2 x FSDP2 over dp=2 (4 ranks; the mesh from Worker.device_mesh over a ResourcePool, sliced
  into "dp_shard" and "tp"; meta init + broadcast by load_sharded_model; activation checkpointing
  on), causal LM and critic, each dp rank on half the rows: the same checks, and under 30% of the
  parameters per rank.
Runtime on 2 cores shared with other work: ~25 s + ~70 s + ~95 s (the last one marked slow).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

ROWS, SEQ, RESP, TEMP = 4, 9, 4, 0.8
OPTIM = dict(lr=1e-2, eps=1e-6, weight_decay=0.01)
MAX_NORM = 0.05  # below the gradient norms: clipping acts
REPLICATED = ("norm", "o_proj.bias", "down_proj.bias", "score")  # parameter names TP keeps whole


def _batch(vocab: int):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[3, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    adv = torch.randn(ROWS, RESP, generator=g, dtype=torch.float64)
    return ids, mask, pos, adv


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _params(model) -> dict:
    return {n: _full(p.detach()).numpy().copy() for n, p in model.named_parameters()}


def _clipped_step(model):
    """The workers' gradient clipping (the norm reduces over every mesh axis), then AdamW; returns the norm."""
    from tinyzero.workers.update import clip_grad_norm

    norm = clip_grad_norm(list(model.parameters()), MAX_NORM)
    torch.optim.AdamW(model.parameters(), **OPTIM).step()
    return norm.detach().reshape(1).numpy()


def _policy_step(model, rows=slice(None), scale: float = 1.0):
    """Response log-probs / entropy as the workers compute them (plain and packed), the full logits, then
    one AdamW step."""
    from tinyzero.workers.forward import attach_log_prob_method, response_log_probs

    ids, mask, pos, adv = (t[rows] for t in _batch(model.config.vocab_size))
    attach_log_prob_method(model)
    model.train()
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, -RESP:]}
    with torch.no_grad():
        packed = [t.numpy() for p in ("remove_padding", "shared_prefix")
                  for t in response_log_probs(model, batch, TEMP, True, p)]
    logp, ent = model.token_log_probs(ids, mask, pos, ids[:, -RESP:], TEMP, return_entropy=True)
    loss = (-(logp * adv).sum() - 0.01 * ent.sum()) / (ROWS * RESP) * scale
    loss.backward()
    norm = _clipped_step(model)
    with torch.no_grad():
        logits = _full(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits)
    return logp.detach().numpy(), ent.detach().numpy(), logits.numpy(), *packed, norm, _params(model)


def _value_step(model, rows=slice(None), scale: float = 1.0):
    """Values at every position, response values packed, then one AdamW step on a squared error."""
    from tinyzero.workers.forward import response_values

    ids, mask, pos, adv = (t[rows] for t in _batch(model.config.vocab_size))
    model.train()
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, -RESP:]}
    with torch.no_grad():
        packed = response_values(model, batch, "remove_padding").numpy()
    values = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0]  # (rows, seq)
    loss = ((values[:, -RESP - 1:-1] - adv) ** 2).sum() / (ROWS * RESP) * scale
    loss.backward()
    norm = _clipped_step(model)
    return values.detach().numpy(), packed, norm, _params(model)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                         tie_word_embeddings=False, max_position_embeddings=64, attn_implementation="sdpa")
    return LlamaForCausalLM(config).double()


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(4)
    config = Qwen3Config(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         max_position_embeddings=64, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config).double()
    with torch.no_grad():  # q_norm / k_norm start at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _qwen2(path):
    from tinyzero.models.loading import load_causal_lm

    return load_causal_lm(path, dtype="fp32", attn_implementation="sdpa").double()


def _critic(path):
    from tinyzero.models.value import load_value_model

    return load_value_model(path, dtype="fp32", attn_implementation="sdpa").double()


def _local_numel(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def _expected_numel(model, tp: int, rank: int) -> int:
    """This rank's share under the plan, from the plain model: vocabulary rows by torch.chunk, the named
    replicated parameters whole, every other matrix / bias 1/tp."""
    total = 0
    for name, p in model.named_parameters():
        if any(k in name for k in REPLICATED):
            total += p.numel()
        elif "embed_tokens" in name or "lm_head" in name:
            total += torch.chunk(p, tp)[rank].numel()
        else:
            assert p.numel() % tp == 0, name
            total += p.numel() // tp
    return total


# ---------------------------------------------------------------------------- the kernel

V, H, SHAPE = 37, 8, (3, 5)


def _kernel_problem(dtype):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(*SHAPE, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, SHAPE, generator=g)
    a, b = torch.randn(SHAPE, generator=g, dtype=torch.float64), torch.randn(SHAPE, generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), labels, a, b


def _kernel_reference():
    hidden, weight, labels, a, b = _kernel_problem(torch.float64)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    logp_all = torch.log_softmax(hidden @ weight.T / TEMP, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((a * logp).sum() + (b * ent).sum()).backward()
    return [t.detach().numpy() for t in (logp, ent, hidden.grad, weight.grad)]


def _kernel_ranks():
    import torch.distributed as dist
    from tinyzero.kernels import HAS_TRITON, linear_log_probs, vocab_parallel_log_probs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tinyzero.distributed import init_distributed

    init_distributed(timeout_s=120)
    rank, tp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    out = {}
    cases = [(torch.float64, "torch"), (torch.float32, "torch")] + ([(torch.float32, "triton")] if HAS_TRITON else [])
    for dtype, backend in cases:
        hidden, weight, labels, a, b = _kernel_problem(dtype)
        start = sum(c.shape[0] for c in torch.chunk(weight, tp)[:rank])
        shard = torch.chunk(weight, tp)[rank].clone().requires_grad_(True)
        hidden.requires_grad_(True)
        logp, ent = vocab_parallel_log_probs(hidden, shard, labels, start, mesh.get_group(), temperature=TEMP,
                                             return_entropy=True, chunk_size=4, backend=backend)
        assert logp.dtype == ent.dtype == dtype
        ((a * logp).sum() + (b * ent).sum()).backward()
        # this rank's rows of the full weight gradient; the other rows are zero (they belong to the peer)
        grad_w = torch.zeros(weight.shape, dtype=dtype)
        grad_w[start:start + shard.shape[0]] = shard.grad
        out[f"{backend} {dtype}"] = [t.detach().double().numpy() for t in (logp, ent, hidden.grad, grad_w)]
    # linear_log_probs dispatches a vocabulary-sharded DTensor weight; hidden arrives sequence-sharded
    hidden, weight, labels, a, b = _kernel_problem(torch.float64)
    w_dt = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_(True)
    h_dt = distribute_tensor(hidden, mesh, [Shard(1)]).requires_grad_(True)
    logp, ent = linear_log_probs(h_dt, w_dt, labels, temperature=TEMP, return_entropy=True, chunk_size=4)
    ((a * logp).sum() + (b * ent).sum()).backward()
    out["dtensor"] = [t.detach().numpy() for t in (logp, ent, h_dt.grad.full_tensor(), w_dt.grad.full_tensor())]
    return out


@pytest.mark.slow
def test_vocab_parallel_log_probs_and_grads_match_float64():
    from tinyzero.kernels import HAS_TRITON

    ref = _kernel_reference()
    # Triton kernels run in the interpreter on CPU tensors (read when triton is first imported by a rank)
    ranks = run_distributed(_kernel_ranks, 2, timeout=240, env={"TRITON_INTERPRET": "1"})
    cases = [("torch torch.float64", 1e-10), ("dtensor", 1e-10), ("torch torch.float32", 2e-5)]
    cases += [("triton torch.float32", 2e-5)] if HAS_TRITON else []
    for key, _ in cases:  # each rank holds its own rows of the weight gradient: add them up
        if key != "dtensor":
            whole = sum(per_rank[key][3] for per_rank in ranks)
            for per_rank in ranks:
                per_rank[key][3] = whole
    for per_rank in ranks:
        for key, tol in cases:
            for what, got, want in zip(("log-probs", "entropy", "grad hidden", "grad weight"), per_rank[key], ref):
                torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), atol=tol, rtol=tol,
                                           msg=lambda m, k=key, w=what: f"{k} {w}: {m}")


# ---------------------------------------------------------------------------- tp=2 models


def _model_ranks(path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tinyzero.distributed import init_distributed
    from tinyzero.models.tensor_parallel import apply_tensor_parallel

    init_distributed(timeout_s=120)
    rank, tp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, tp), mesh_dim_names=("dp_shard", "tp"))["tp"]
    out = {}
    for name, build, step in (("qwen2", _qwen2, _policy_step), ("llama", lambda p: _tiny_llama(), _policy_step),
                              ("qwen3", lambda p: _tiny_qwen3(), _policy_step), ("critic", _critic, _value_step)):
        model = build(path)
        tied = model.get_output_embeddings() is not None and \
            model.get_output_embeddings().weight is model.get_input_embeddings().weight
        expected = _expected_numel(model, tp, rank)
        apply_tensor_parallel(model, mesh)
        if tied:
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        out[name] = (step(model), _local_numel(model), expected)
    return out


def _references(path):
    torch.manual_seed(0)
    return {"qwen2": _policy_step(_qwen2(path)), "llama": _policy_step(_tiny_llama()),
            "qwen3": _policy_step(_tiny_qwen3()), "critic": _value_step(_critic(path))}


def _compare(got, want, name):
    *outs, params = got
    *ref_outs, ref_params = want
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), atol=1e-10, rtol=1e-10,
                                   msg=lambda m, i=i: f"{name} output {i}: {m}")
    assert params.keys() == ref_params.keys()
    for key in params:
        torch.testing.assert_close(torch.from_numpy(params[key]), torch.from_numpy(ref_params[key]), atol=1e-8,
                                   rtol=1e-8, msg=lambda m, k=key: f"{name} parameter {k} after one step: {m}")


@pytest.mark.slow
def test_tp2_models_match_the_untouched_model(tiny_model_dir):
    ranks = run_distributed(_model_ranks, 2, tiny_model_dir, timeout=300)
    ref = _references(tiny_model_dir)
    full = {"qwen2": _local_numel(_qwen2(tiny_model_dir)), "llama": _local_numel(_tiny_llama()),
            "qwen3": _local_numel(_tiny_qwen3()), "critic": _local_numel(_critic(tiny_model_dir))}
    for name in ref:
        for per_rank in ranks:
            result, numel, expected = per_rank[name]
            _compare(result, ref[name], name)
            assert numel == expected, f"{name}: {numel} parameters on a rank, expected {expected}"
            assert numel < 0.75 * full[name], f"{name}: {numel} of {full[name]} parameters on one rank"


# ---------------------------------------------------------------------------- tp=2 x FSDP2 dp=2


def _fsdp_tp_ranks(path):
    import torch.distributed as dist

    from tinyzero.distributed import init_distributed
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.fsdp import load_sharded_model
    from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, Worker, WorkerGroup

    init_distributed(timeout_s=120)
    wg = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=ClassWithInitArgs(Worker))
    mesh = wg.worker.device_mesh((2, 2), ("dp_shard", "tp"))  # the mesh a role builds over its pool
    fsdp_cfg = FSDPConfig()
    fsdp_cfg.mixed_precision.param_dtype = fsdp_cfg.mixed_precision.reduce_dtype = torch.float64
    dp = mesh["dp_shard"].get_local_rank()
    rows = slice(dp * ROWS // 2, (dp + 1) * ROWS // 2)
    out = {}
    for kind, step in (("causal_lm", _policy_step), ("value", _value_step)):
        model = load_sharded_model(ModelConfig(path=path, enable_gradient_checkpointing=True), fsdp_cfg,
                                   mesh["dp_shard"], kind=kind, dtype=torch.float64, tp_mesh=mesh["tp"])
        numel = _local_numel(model)  # before any forward leaves a layer gathered
        # FSDP averages gradients over the dp ranks: scale each rank's share of the global loss by dp.
        out[kind] = (step(model, rows, scale=2.0), numel)
    return dist.get_rank(), dp, out


@pytest.mark.slow
def test_tp2_fsdp2_on_a_worker_mesh_matches_one_rank(tiny_model_dir):
    ranks = run_distributed(_fsdp_tp_ranks, 4, tiny_model_dir, timeout=400)
    ref = {"causal_lm": _policy_step(_qwen2(tiny_model_dir)), "value": _value_step(_critic(tiny_model_dir))}
    full = {"causal_lm": _local_numel(_qwen2(tiny_model_dir)), "value": _local_numel(_critic(tiny_model_dir))}
    half = ROWS // 2
    for _, dp, out in ranks:
        rows = slice(dp * half, (dp + 1) * half)
        for kind, ((*outs, params), numel) in out.items():
            want = ref[kind]
            outs_ref = [o[rows] if o.shape[0] == ROWS else o for o in want[:-1]]  # the grad norm is global
            _compare((*outs, params), (*outs_ref, want[-1]), f"tp2 x dp2 {kind}")
            # 1 / (tp x dp) of the model, plus the replicated norms / head each tp rank also holds a quarter of
            assert numel < 0.3 * full[kind], f"{kind}: {numel} of {full[kind]} parameters on one rank"


# ---------------------------------------------------------------------------- validation


def test_layouts_tp_cannot_split_are_refused_with_the_setting_to_change(tiny_model_dir):
    from transformers import Qwen2Config

    from tinyzero.models.tensor_parallel import check_tensor_parallel, tensor_parallel_plan

    config = Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2)
    check_tensor_parallel(config, 2)  # an uneven vocabulary is fine: DTensor splits it 130 / 129
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tensor_parallel(config, 4)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        check_tensor_parallel(config, 3)
    model = _qwen2(tiny_model_dir)
    assert len(tensor_parallel_plan(model)) == 2 + 2 * 11 + 1  # embed, final norm, 11 per block, lm_head
    model.model.layers[1].self_attn.q_proj = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj is Identity"):
        tensor_parallel_plan(model)
