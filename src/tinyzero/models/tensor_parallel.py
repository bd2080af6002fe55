"""Tensor parallelism (DTensor) for HF Llama-family and Qwen2 / Qwen3 models, applied from outside.

    tp_mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))["tp"]
    apply_tensor_parallel(model, tp_mesh)       # before fully_shard (models.fsdp.parallelize does both)

The plan (Megatron's layout, written with torch.distributed.tensor.parallel as torchtitan does):

- embed_tokens: sharded along the vocabulary (RowwiseParallel on nn.Embedding); its output leaves
  sequence-sharded (Shard(1)) after one reduce-scatter;
- input / post-attention / final RMSNorms (and Qwen3's per-head q_norm / k_norm): sequence-parallel,
  their weights replicated; the residual stream between blocks stays a Shard(1) DTensor; the final
  norm's output is all-gathered into a plain tensor (the same on every rank), so `last_hidden_state`
  is sliced, packed and indexed by callers exactly as without TP;
- attention and MLP inputs are all-gathered along the sequence; q/k/v (with their bias on Qwen2)
  and gate/up are column-parallel, so each rank runs attention on its own heads (HF reshapes with
  `view(*shape, -1, head_dim)`, so the local head count needs no change); o/down are row-parallel
  and reduce-scatter back to Shard(1);
- lm_head: sharded along the vocabulary (weight Shard(0)); `kernels.linear_log_probs` given that
  weight computes vocabulary-parallel log-probs, so no rank builds the full vocabulary's logits.
  A plain `model(...)` call returns `.logits` as a DTensor sharded on the vocabulary. A tied lm_head
  is the embedding's parameter, sharded once for both uses;
- a value / reward model's scalar head (`score`) is replicated: it sees the gathered sequence.

The residual stream is kept as DTensors (not local tensors) so that sequence lengths that tp does
not divide work, and HF's mask building sees the global sequence length. Vocabulary sizes that
tp does not divide are sharded unevenly (DTensor's torch.chunk split); heads, key/value heads and
the intermediate size must divide (`check_tensor_parallel`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tinyzero.models.families import ModelFamily, family_of

_HEADS = ("score",)  # scalar heads of value (token classification) and reward (sequence classification) models


def check_tensor_parallel(config, tp: int, what: str = "tensor_model_parallel_size") -> None:
    """Raise ValueError unless the model's heads, key/value heads and intermediate size split over tp."""
    if tp < 1:
        raise ValueError(f"{what}={tp} must be >= 1")
    heads = config.num_attention_heads
    checks = [("num_attention_heads", heads),
              ("num_key_value_heads", getattr(config, "num_key_value_heads", None) or heads),
              ("intermediate_size", config.intermediate_size)]
    for name, value in checks:
        if value % tp:
            raise ValueError(f"{what}={tp} does not divide the model's {name}={value}; choose a tensor-parallel "
                             f"size that divides {name}")
    if config.vocab_size < tp:
        raise ValueError(f"{what}={tp} exceeds the model's vocab_size={config.vocab_size}")


class ReplicatedHead(ParallelStyle):
    """Parameters replicated on the mesh; a DTensor input is gathered to Replicate; the output is local.

    For small heads (hidden -> 1) that every rank computes whole on the full sequence.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_replicate_inputs, output_fn=_local_output)


def _replicate_inputs(module, inputs, device_mesh):
    return tuple(x.redistribute(placements=[Replicate()]) if isinstance(x, DTensor)
                 else DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) for x in inputs)


def _local_output(module, output, device_mesh):
    return output.to_local() if isinstance(output, DTensor) else output


def _backbone(model: nn.Module) -> nn.Module:
    prefix = getattr(model, "base_model_prefix", "model")
    backbone = getattr(model, prefix, None)
    if backbone is None or not all(hasattr(backbone, a) for a in ("embed_tokens", "layers", "norm")):
        raise ValueError(f"{type(model).__name__}: tensor parallelism supports Llama-family and Qwen2/Qwen3 "
                         f"models (a backbone `{prefix}` with embed_tokens, layers and norm)")
    return backbone


def _check_linear(layer: nn.Module, names: tuple[str, ...], where: str) -> None:
    for name in names:
        sub = getattr(layer, name, None)
        if type(sub) is not nn.Linear:
            raise ValueError(f"{where}.{name} is {type(sub).__name__}, not nn.Linear: tensor parallelism needs the "
                             "plain HF projections (LoRA adapters and quantized layers are not supported with "
                             "tensor_model_parallel_size > 1)")


def _block_plan(layer: nn.Module, where: str, family: ModelFamily) -> dict[str, ParallelStyle]:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        raise ValueError(f"{where} has no self_attn / mlp; tensor parallelism supports Llama-family and Qwen2/Qwen3")
    _check_linear(attn, family.attention, f"{where}.self_attn")
    _check_linear(mlp, family.mlp, f"{where}.mlp")
    q, k, v, o = family.attention
    gate, up, down = family.mlp
    plan: dict[str, ParallelStyle] = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=True),
        f"self_attn.{q}": ColwiseParallel(),
        f"self_attn.{k}": ColwiseParallel(),
        f"self_attn.{v}": ColwiseParallel(),
        f"self_attn.{o}": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True),
        f"mlp.{gate}": ColwiseParallel(),
        f"mlp.{up}": ColwiseParallel(),
        f"mlp.{down}": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    for norm in ("q_norm", "k_norm"):  # Qwen3: RMSNorm over head_dim of (batch, seq, local heads, head_dim)
        if isinstance(getattr(attn, norm, None), nn.Module):
            plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Module path -> ParallelStyle for a HF causal LM, value or reward model (see the module docstring)."""
    backbone = _backbone(model)
    family = family_of(model)
    prefix = getattr(model, "base_model_prefix", "model")
    plan: dict[str, ParallelStyle] = {
        f"{prefix}.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                  use_local_output=False),
        f"{prefix}.norm": SequenceParallel(),
    }
    for i, layer in enumerate(backbone.layers):
        where = f"{prefix}.layers.{i}"
        plan |= {f"{where}.{k}": v for k, v in _block_plan(layer, where, family).items()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        name = next(n for n, m in model.named_modules() if m is head)
        plan[name] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    for name in _HEADS:
        if isinstance(getattr(model, name, None), nn.Module):
            plan[name] = ReplicatedHead()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard `model` in place over the 1-D mesh `tp_mesh` (see the module docstring); return it.

    Call before fully_shard (FSDP2 then shards the DTensors over its data-parallel mesh, which must
    come from the same parent mesh as tp_mesh). Works on the meta device.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (slice it from the parallel mesh, e.g. mesh['tp']); got shape "
                         f"{tuple(tp_mesh.shape)}")
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no HF config; tensor parallelism needs a HF model")
    check_tensor_parallel(config, tp_mesh.size())
    inp = model.get_input_embeddings()
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = out is not None and out.weight is inp.weight
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model))
    # The final norm's output is gathered once into a plain tensor, the same on every rank: callers slice,
    # pack and index `last_hidden_state` as without TP, and the heads need the whole sequence anyway.
    parallelize_module(_backbone(model).norm, tp_mesh,
                       PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                           use_local_output=True))
    if tied:  # both styles shard the weight Shard(0): keep one parameter for both uses
        out.weight = inp.weight
    return model
