"""Model and FSDP2 configuration (field names follow veRL's `actor_rollout_ref.model` / `fsdp_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

DtypeName = Literal["auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "fp64", "float64"]
AttnImplementation = Literal["auto", "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"]
DTYPE_NAMES = get_args(DtypeName)
ATTN_IMPLEMENTATIONS = get_args(AttnImplementation)


@dataclass
class ModelConfig:
    """Where a model comes from and how it is instantiated (veRL: `actor_rollout_ref.model`)."""

    path: str = ""
    """Local folder of a HF model (config.json + safetensors). Nothing is downloaded."""
    tokenizer_path: str = ""
    """Folder of the tokenizer; empty means the same as `path`."""
    trust_remote_code: bool = False
    """Allow executing model / tokenizer code shipped inside the model folder. Off unless you trust it."""
    dtype: DtypeName = "fp32"
    """Dtype the model's weights are held in (tinyzero.models.precision). A trained model (actor, critic, SFT /
    RM / DPO policy) keeps fp32 master weights and AdamW state: "auto" and "fp32" mean fp32 there, and
    "bf16" / "fp16" are refused. Frozen copies (reference, a scoring reward model, the base under LoRA)
    follow "auto" to the compute dtype (`FSDPConfig.mixed_precision.param_dtype`: bf16 on GPU, fp32 on
    CPU) or take the named dtype. "fp64" (with fp64 mixed precision) gives float64 reference runs on CPU."""
    attn_implementation: AttnImplementation = "auto"
    """HF attention kernel: "auto" picks flash_attention_2 on GPU when installed, else sdpa."""
    enable_gradient_checkpointing: bool = True
    """Recompute decoder-layer activations in backward (activation checkpointing) to save memory."""
    gradient_checkpointing_every_n_layers: int = 1
    """With enable_gradient_checkpointing, recompute only layers 0, n, 2n, ... (selective checkpointing): the
    others keep their activations, so backward holds about (1 - 1/n) of what it holds without checkpointing,
    for about 1/n of the recompute. 1 recomputes every layer."""
    use_fused_layers: bool | None = None
    """RMSNorms and SwiGLU MLPs that keep less for backward (tinyzero.models.fused_layers): the same forward,
    about a third less activation memory in training, for a few elementwise ops in backward. Not with
    tensor parallelism. None: the run plan decides (on for PPO on CPU hosts without tensor parallelism or
    LoRA; tinyzero.plan)."""
    override_config: dict = field(default_factory=dict)
    """Entries that override the model's config.json (e.g. {"attention_dropout": 0.0})."""
    use_remove_padding: bool | None = None
    """Packed training passes (log-probs, values, updates): several sequences share one row with a
    block-diagonal causal mask, so padding is not computed (tinyzero.workers.packing). None: the run plan
    decides (on for PPO on CPU hosts; tinyzero.plan)."""
    use_shared_prefix: bool | None = None
    """Packed training passes that also compute each group's shared prompt once: the n responses of a
    prompt are packed as [prompt, response_1 .. response_n], each seeing the prompt and itself only.
    Exact (same loss and gradients); implies use_remove_padding. None: the run plan decides (on for PPO
    with rollout.n > 1 on CPU hosts; tinyzero.plan)."""
    lora_rank: int = 0
    """LoRA rank of the actor's adapters; 0 trains all weights. With LoRA the base weights are frozen, only
    the adapters (kept fp32) get gradients and optimizer state, the reference policy is the base with the
    adapters disabled (no second copy), and weight sync and checkpoints carry the adapters only."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: a layer computes W x + (lora_alpha / lora_rank) B A x."""
    target_modules: str | list[str] = "all-linear"
    """Layers that get adapters: "all-linear" (every linear layer but the output head, as PEFT) or a list of
    module names matched by their last parts (e.g. ["q_proj", "v_proj"])."""
    lora_export_merged: bool = False
    """With LoRA, the HF export also writes the merged model (W + scale * B A) to `<export>/merged`."""

    def __post_init__(self):
        if self.lora_rank < 0:
            raise ValueError(f"model.lora_rank={self.lora_rank} must be >= 0 (0 turns LoRA off)")
        if self.lora_rank and self.lora_alpha <= 0:
            raise ValueError(f"model.lora_alpha={self.lora_alpha} must be > 0 (e.g. 16, or 2 * lora_rank)")
        targets = self.target_modules
        if not (targets == "all-linear" or (isinstance(targets, (list, tuple)) and targets
                                            and all(isinstance(t, str) and t for t in targets))):
            raise ValueError(f"model.target_modules={targets!r}: use 'all-linear' or a non-empty list of "
                             "module names such as ['q_proj', 'v_proj']")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"model.dtype={self.dtype!r} is not one of {DTYPE_NAMES}")
        if not isinstance(self.gradient_checkpointing_every_n_layers, int) or self.gradient_checkpointing_every_n_layers < 1:
            raise ValueError(f"model.gradient_checkpointing_every_n_layers={self.gradient_checkpointing_every_n_layers!r}: "
                             "use 1 (recompute every layer) or more")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"model.attn_implementation={self.attn_implementation!r} is not one of {ATTN_IMPLEMENTATIONS}"
            )
        if not isinstance(self.override_config, dict):
            raise ValueError("model.override_config must be a mapping of config.json keys to values")

    @property
    def resolved_tokenizer_path(self) -> str:
        """The folder the tokenizer is read from."""
        return self.tokenizer_path or self.path


@dataclass
class MixedPrecisionConfig:
    """FSDP2 MixedPrecisionPolicy (veRL: `fsdp_config.mixed_precision`)."""

    param_dtype: DtypeName = "auto"
    """Dtype parameters are all-gathered in and compute runs in. "auto": bf16 on GPU, fp32 on CPU."""
    reduce_dtype: DtypeName = "fp32"
    """Dtype of the gradient reduce-scatter / all-reduce."""
    output_dtype: DtypeName = "auto"
    """Dtype the wrapped modules' outputs are cast to; "auto" leaves them as computed."""

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise ValueError(f"fsdp_config.mixed_precision.{name}={getattr(self, name)!r} not in {DTYPE_NAMES}")


@dataclass
class WrapPolicyConfig:
    """Which decoder layers become FSDP2 units of their own (veRL: `fsdp_config.wrap_policy`)."""

    min_num_params: int = 0
    """A decoder layer with at least this many parameters is its own unit: gathered just before its
    forward and backward, freed after (ZeRO-3). Smaller layers stay in the root unit, gathered with
    the embeddings in one collective per forward and reduced in one per backward: fewer, larger
    collectives, for models whose layers are too small for their per-collective cost to pay (on
    CPUs with gloo, a few hundred thousand parameters per layer). 0: every layer is a unit."""

    def __post_init__(self):
        if self.min_num_params < 0:
            raise ValueError(f"fsdp_config.wrap_policy.min_num_params={self.min_num_params} must be >= 0")


@dataclass
class FSDPConfig:
    """How a model is sharded with FSDP2 `fully_shard` (veRL: `fsdp_config`)."""

    fsdp_size: int = -1
    """Ranks one copy of the model is sharded over. -1: all ranks of the pool (plain FSDP). A smaller
    divisor of the pool size gives hybrid sharding: shard within groups of `fsdp_size` ranks, replicate
    across the pool_size / fsdp_size groups (2-D mesh ("dp_replicate", "dp_shard"); see tinyzero.distributed.parallel_dims)."""
    param_offload: bool = False
    """Keep parameters (and gradients) on CPU between phases; loaded to the device for forward/backward.
    With `offload_policy=True` FSDP2's CPUOffloadPolicy keeps them on CPU all the time instead."""
    optimizer_offload: bool = False
    """Keep optimizer state on CPU between optimizer steps (moved to the device for `step()`)."""
    offload_policy: bool = False
    """Use FSDP2's CPUOffloadPolicy: sharded params, grads and the optimizer step live on CPU; only the
    all-gathered layer visits the device."""
    reshard_after_forward: bool = True
    """Free the all-gathered parameters after each layer's forward (ZeRO-3). False keeps them until
    backward (ZeRO-2 style: more memory, fewer all-gathers)."""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """Compute / reduce dtypes."""
    wrap_policy: WrapPolicyConfig = field(default_factory=WrapPolicyConfig)
    """Which decoder layers are FSDP2 units of their own."""

    def __post_init__(self):
        if self.fsdp_size == 0 or self.fsdp_size < -1:
            raise ValueError(f"fsdp_config.fsdp_size={self.fsdp_size}: use -1 (all ranks) or a positive size")
        if isinstance(self.mixed_precision, dict):
            self.mixed_precision = MixedPrecisionConfig(**self.mixed_precision)
        if isinstance(self.wrap_policy, dict):
            self.wrap_policy = WrapPolicyConfig(**self.wrap_policy)
