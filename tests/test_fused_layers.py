"""model.use_fused_layers (tinyzero.models.fused_layers): RMSNorm and SwiGLU that keep less for backward.

Against the HF modules they replace (autograd through HF's own forward): the forward is bit for bit
the same; gradients agree to rounding. HF's RMSNorm computes in fp32 whatever its input dtype (a
float64 model too), so the norms' gradients agree to fp32 rounding (relative 1e-6) even in float64;
the SwiGLU's to 1e-12 in float64, 1e-5 in fp32, bf16 rounding under bf16. The bytes kept for backward are counted with saved-tensor hooks and equal
what the functions are meant to keep. A whole model (Llama and Qwen3: q/k norms) with fused layers
has the same loss and gradients as without, in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tinyzero.models.fused_layers import apply_fused_layers, is_rms_norm, is_swiglu_mlp


def _llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, **kw)


def _saved_bytes(module, fn) -> int:
    """Bytes of the distinct storages autograd keeps while fn() runs, the module's parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_matches_hf(dtype, tol):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    ref = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.3 * torch.randn(32, generator=g))
    ref = ref.to(dtype)
    fused = copy.deepcopy(ref)
    assert apply_fused_layers(fused) == 1 and is_rms_norm(ref)
    x = (3 * torch.randn(2, 5, 32, generator=g, dtype=torch.float64)).to(dtype)
    gy = torch.randn(2, 5, 32, generator=g, dtype=torch.float64).to(dtype)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ref_bytes, y_ref = _saved_bytes(ref, lambda: ref(xs[0]))
    fused_bytes, y = _saved_bytes(fused, lambda: fused(xs[1]))
    assert torch.equal(y, y_ref)  # the same forward, op for op
    y_ref.backward(gy)
    y.backward(gy)
    for a, b in ((xs[1].grad, xs[0].grad), (fused.weight.grad, ref.weight.grad)):
        assert a.dtype == b.dtype
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        assert err <= tol, (dtype, err)
    size = torch.finfo(dtype).bits // 8
    assert fused_bytes == 2 * 5 * 32 * size + 2 * 5 * 4  # x in its dtype + one fp32 rsqrt per token
    assert fused_bytes < ref_bytes


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_swiglu_mlp_matches_hf(dtype, tol, bias):
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    ref = LlamaMLP(_llama_config(mlp_bias=bias)).to(dtype)
    if bias:
        with torch.no_grad():
            for p in ref.parameters():
                if p.dim() == 1:
                    p.normal_()
    fused = copy.deepcopy(ref)
    assert is_swiglu_mlp(ref) and apply_fused_layers(fused) == 1
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 32, generator=g, dtype=torch.float64).to(dtype)
    gy = torch.randn(3, 4, 32, generator=g, dtype=torch.float64).to(dtype)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ref_bytes, y_ref = _saved_bytes(ref, lambda: ref(xs[0]))
    fused_bytes, y = _saved_bytes(fused, lambda: fused(xs[1]))
    assert torch.equal(y, y_ref)
    y_ref.backward(gy)
    y.backward(gy)
    pairs = [(xs[1].grad, xs[0].grad)] + [(p.grad, q.grad) for p, q in zip(fused.parameters(), ref.parameters())]
    for a, b in pairs:
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        assert err <= tol, (dtype, err)
    size = torch.finfo(dtype).bits // 8
    # kept: x (for gate/up), gate and up; HF also keeps silu(gate) and the product (for down_proj)
    assert fused_bytes == 12 * (32 + 2 * 48) * size
    assert ref_bytes - fused_bytes == 2 * 12 * 48 * size


def test_swiglu_mlp_keeps_the_product_for_a_down_proj_that_is_not_a_plain_linear():
    """A down_proj of another class (a LoRA layer, say) is called as a module on the product, which it keeps."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    ref = LlamaMLP(_llama_config())
    ref.down_proj = Scaled(48, 32, bias=False)
    fused = copy.deepcopy(ref)
    assert apply_fused_layers(fused) == 1
    x = torch.randn(3, 4, 32, requires_grad=True)
    ref_bytes, y_ref = _saved_bytes(ref, lambda: ref(x))
    fused_bytes, y = _saved_bytes(fused, lambda: fused(x))
    assert torch.equal(y, y_ref)
    assert fused_bytes == 12 * (32 + 3 * 48) * 4 and ref_bytes - fused_bytes == 12 * 48 * 4
    y.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    y_ref.sum().backward()
    assert torch.allclose(grad, x.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_whole_model_same_loss_and_gradients(kind):
    from transformers import LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(_llama_config()).double()
    else:
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                             max_position_embeddings=64)).double()
    fused = copy.deepcopy(model)
    layers = 2
    per_layer = 2 + 1 + (2 if kind == "qwen3" else 0)  # 2 norms, the MLP, (q_norm, k_norm)
    assert apply_fused_layers(fused) == layers * per_layer + 1  # + the final norm
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    losses = []
    for m in (model, fused):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):  # the norms' fp32 math: see above
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-8), name
    # names and state dicts are untouched: loading, sharding and weight sync see the HF model
    assert list(model.state_dict()) == list(fused.state_dict())
