"""The training precision policy: which dtype each copy of a model's numbers lives in, decided here only.

    policy = resolve_precision(model_config, fsdp_config, "cuda", trainable=True)
    policy.master_dtype        # the parameters FSDP2 shards and AdamW updates: fp32 for a trained model
    policy.optim_state_dtype   # AdamW's exp_avg / exp_avg_sq (torch keeps them in the parameter's dtype)
    policy.compute_dtype       # what forward and backward run in: bf16 on a bf16 GPU by default, fp32 on CPU
    policy.mp_policy()         # the FSDP2 MixedPrecisionPolicy that casts master -> compute per unit

The rule (veRL's): weights that train are held in fp32 (fp64 for float64 reference runs), whatever the
device; only the compute dtype differs between CPU and GPU. At RL learning rates (1e-6 .. 1e-5) an AdamW
step moves a weight by about lr, far below half a bf16 unit in the last place of a typical weight, so
bf16 master weights would silently drop most updates; a half-precision `model.dtype` for a trained
model is therefore refused. Frozen copies (the reference policy, a teacher, a reward model used for
scoring, the frozen base under LoRA adapters) hold their weights in the compute dtype when
`model.dtype="auto"`: they are only read in the compute dtype anyway. LoRA adapters are fp32.

Only a GPU can show the bf16 kernels actually running (scripts/gpu_check.py checks the live model's
dtypes on CUDA); the decisions themselves are tested on CPU with CUDA availability faked.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from tinyzero.models.loading import pick_dtype

_HALF = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """One role's dtypes (see the module docstring)."""

    master_dtype: torch.dtype
    """The dtype the model's parameters are held (and sharded) in."""
    adapter_dtype: torch.dtype
    """LoRA adapters' dtype (they are the trained parameters when LoRA is on)."""
    optim_state_dtype: torch.dtype
    """AdamW state dtype: that of the trained parameters (none for a frozen role)."""
    compute_dtype: torch.dtype
    """FSDP2's param_dtype: forward and backward run in it."""
    reduce_dtype: torch.dtype
    """Gradient reduce-scatter / all-reduce dtype."""
    output_dtype: torch.dtype | None
    """Dtype the sharded units' outputs are cast to; None leaves them as computed."""

    def mp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's MixedPrecisionPolicy for this policy."""
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype,
                                    output_dtype=self.output_dtype, cast_forward_inputs=True)


def compute_dtypes(fsdp_config, device_type: str) -> tuple[torch.dtype, torch.dtype, torch.dtype | None]:
    """(compute, reduce, output) dtypes from `fsdp_config.mixed_precision` on `device_type`."""
    mp = fsdp_config.mixed_precision
    compute = pick_dtype(device_type, mp.param_dtype)
    reduce = pick_dtype(device_type, mp.reduce_dtype)
    output = None if mp.output_dtype == "auto" else pick_dtype(device_type, mp.output_dtype)
    return compute, reduce, output


def resolve_precision(model_config, fsdp_config, device_type: str, trainable: bool,
                      dtype: str | torch.dtype | None = None) -> PrecisionPolicy:
    """The dtypes of one role's model on `device_type` ("cuda" / "cpu").

    `trainable`: the role's optimizer updates this model (actor, critic, SFT / RM / DPO policy).
    `dtype` overrides `model_config.dtype`. Raises ValueError for half-precision master weights of a
    trained model, naming the setting to change.
    """
    compute, reduce, output = compute_dtypes(fsdp_config, device_type)
    requested = model_config.dtype if dtype is None else dtype
    lora = bool(getattr(model_config, "lora_rank", 0))
    weights_train = trainable and not lora
    if requested == "auto":
        master = torch.float32 if weights_train else compute
    else:
        master = pick_dtype(device_type, requested)
    if weights_train and master in _HALF:
        name = str(master).removeprefix("torch.")
        raise ValueError(
            f"model.dtype={requested} would hold the trained weights and AdamW state in {name}, where updates at "
            f"RL learning rates round away; set model.dtype=fp32 (or auto) and choose the compute dtype with "
            f"fsdp_config.mixed_precision.param_dtype (bf16 on GPU by default)")
    trained = torch.float32 if lora else master
    return PrecisionPolicy(master_dtype=master, adapter_dtype=torch.float32,
                           optim_state_dtype=trained if trainable else master, compute_dtype=compute,
                           reduce_dtype=reduce, output_dtype=output)


def check_trained_dtypes(model: torch.nn.Module, policy: PrecisionPolicy) -> None:
    """Every parameter that trains is held in the policy's trained dtype (an internal invariant)."""
    want = policy.optim_state_dtype
    bad = [(n, p.dtype) for n, p in model.named_parameters() if p.requires_grad and p.dtype != want]
    assert not bad, f"trained parameters must be {want}, found {bad[:3]}"
