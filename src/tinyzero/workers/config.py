"""Configs of the training roles: actor, reference, critic, reward model (veRL ppo_trainer.yaml names).

`ActorRolloutRefConfig` is the `actor_rollout_ref` section: the shared `model`, the `actor`
(PPO update), the `rollout` engine and the `ref` policy. `CriticConfig` and
`RewardModelConfig` are the `critic` and `reward_model` sections. Batch sizes follow veRL:
`ppo_mini_batch_size` counts prompts (the worker multiplies it by `rollout.n` and divides by
the data-parallel size); every `*_per_gpu` size counts rows on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from tinyzero.algorithms import KL_ESTIMATORS as KL_LOSS_TYPES  # one table each, in algorithms
from tinyzero.algorithms import LOSS_AGG_MODES
from tinyzero.distributed.parallel_dims import ParallelDims
from tinyzero.models.config import FSDPConfig, ModelConfig
from tinyzero.rewards.config import RewardManagerName
from tinyzero.rollout.config import RolloutConfig

WarmupStyle = Literal["constant", "cosine"]
OptimImplementation = Literal["auto", "fused", "foreach", "for-loop"]
WARMUP_STYLES = get_args(WarmupStyle)
OPTIM_IMPLEMENTATIONS = get_args(OptimImplementation)
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def _check_positive_or_none(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be a positive integer or None (got {value}); "
                         f"set it to e.g. 4, or None to use the whole per-rank batch in one pass")


class HasLayout:
    """A role section with an `fsdp_config`: its parallel layout comes from here (tinyzero.distributed.parallel_dims)."""

    SECTION: ClassVar[str] = ""

    def parallel_dims(self, pool_size: int) -> ParallelDims:
        """This role's layout on a pool of `pool_size` ranks, validated (messages name this section)."""
        return ParallelDims.for_role(pool_size, self.fsdp_config.fsdp_size,
                                     tp=getattr(self, "tensor_model_parallel_size", 1),
                                     sp=getattr(self, "ulysses_sequence_parallel_size", 1), section=self.SECTION)


@dataclass
class ParallelLayout(HasLayout):
    """The tensor / sequence parallel degrees of a training role (actor, reference, critic)."""

    tensor_model_parallel_size: int = 1
    """Tensor parallelism (DTensor, Megatron's layout: column-parallel q/k/v and gate/up, row-parallel
    o/down, vocabulary-parallel embedding, lm_head and log-probs) over this many consecutive ranks;
    FSDP2 shards over the rest. Must divide the pool size, the heads, kv-heads and intermediate size."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: this many ranks hold the same samples and split their sequence
    (an all-to-all around attention trades it for a head split). Must divide the ranks left after
    tensor parallelism and the attention heads each tensor-parallel rank holds."""

    def check_layout(self) -> None:
        for name in ("tensor_model_parallel_size", "ulysses_sequence_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.SECTION}.{name} must be >= 1 (got {getattr(self, name)})")


def _check_global_micro(section: str, name: str, value: int | None, per_gpu: int | None) -> None:
    """veRL's deprecated global micro-batch size: positive, and not together with its per-GPU form (veRL's rule)."""
    _check_positive_or_none(f"{section}.{name}", value)
    if value is not None and per_gpu is not None:
        raise ValueError(f"{section}.{name}={value} and {section}.{name}_per_gpu={per_gpu} are both set; remove "
                         f"{section}.{name} (veRL's deprecated global form) and keep {name}_per_gpu")


def rollout_dims(rollout: RolloutConfig, pool_size: int) -> ParallelDims:
    """The rollout engines' layout: tensor-parallel groups of consecutive ranks, one data chunk each."""
    return ParallelDims.for_role(pool_size, tp=rollout.tensor_model_parallel_size or 1,
                                 section="actor_rollout_ref.rollout")


def role_layout(section: HasLayout, pool_size: int) -> ParallelDims:
    """A trained or frozen role's layout (actor, reference, critic, reward model) on a pool of `pool_size`."""
    return section.parallel_dims(pool_size)


def policy_layouts(config: ActorRolloutRefConfig, pool_size: int, role: str) -> dict[str, ParallelDims]:
    """The layouts of the policy roles a worker of `role` holds ("actor", "ref", "rollout"), on a pool of
    `pool_size` ranks. With LoRA the reference is the actor's own model with the adapters off, so it
    shares the actor's layout. The run plan calls this once per pool (tinyzero.plan); a worker built
    outside a run (tests, notebooks) calls it itself."""
    is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref", "actor_ref")
    is_ref = role in ("ref", "actor_rollout_ref", "actor_ref")
    is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
    dims = {}
    if is_actor:
        dims["actor"] = role_layout(config.actor, pool_size)
    if is_ref:
        dims["ref"] = dims["actor"] if is_actor and config.model.lora_rank else role_layout(config.ref, pool_size)
    if is_rollout:
        dims["rollout"] = rollout_dims(config.rollout, pool_size)
    return dims


def _check_contents(name: str, contents: list[str]) -> None:
    bad = [c for c in contents if c not in CHECKPOINT_CONTENTS]
    if bad:
        raise ValueError(f"{name} has unknown entries {bad}; choose from {list(CHECKPOINT_CONTENTS)}")


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (linear warmup, then constant or cosine)."""

    lr: float = 1e-6
    """Peak learning rate."""
    lr_warmup_steps: int = -1
    """Warmup steps; a negative value defers to `lr_warmup_steps_ratio`."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup steps as a fraction of `total_training_steps` (used when `lr_warmup_steps` < 0)."""
    min_lr_ratio: float = 0.0
    """Cosine only: the learning rate decays to `min_lr_ratio * lr`."""
    num_cycles: float = 0.5
    """Cosine only: number of cosine periods over the decay phase (0.5 = one half-cosine down)."""
    warmup_style: WarmupStyle = "constant"
    """After warmup: "constant" or "cosine"."""
    total_training_steps: int = -1
    """Optimizer steps of the whole run; the trainer fills it in (needed by cosine and the warmup ratio)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    implementation: OptimImplementation = "auto"
    """AdamW kernel: "fused" (one kernel over all parameters, on CPU and GPU), "foreach" (a few
    multi-tensor ops per step; the same numbers as "for-loop" bit for bit), "for-loop" (one parameter at
    a time, torch's own choice on CPU). "auto": fused when every trainable parameter is on CPU or CUDA,
    else foreach. On FSDP2's DTensor parameters the loop pays DTensor dispatch for every op of every
    parameter; fused agrees with it to rounding (fp32 ~4e-7 after one step) and is ~10x faster on CPU."""

    def __post_init__(self):
        if self.implementation not in OPTIM_IMPLEMENTATIONS:
            raise ValueError(f"optim.implementation={self.implementation!r} is unknown; use one of "
                             f"{list(OPTIM_IMPLEMENTATIONS)}")
        if self.lr < 0:
            raise ValueError(f"optim.lr must be >= 0 (got {self.lr})")
        if self.warmup_style not in WARMUP_STYLES:
            raise ValueError(f"optim.warmup_style={self.warmup_style!r} is unknown; use one of {list(WARMUP_STYLES)}")
        if not 0.0 <= self.lr_warmup_steps_ratio <= 1.0:
            raise ValueError(f"optim.lr_warmup_steps_ratio must be in [0, 1] (got {self.lr_warmup_steps_ratio})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0 (got {self.weight_decay})")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1) (got {self.betas})")


@dataclass
class PolicyLossConfig:
    """Which policy loss of the `tinyzero.algorithms` registry the actor minimises."""

    loss_mode: str = "vanilla"
    """Name in the policy-loss registry: "vanilla" (PPO clipped surrogate with dual clip), "gspo"
    (needs loss_agg_mode=seq-mean-token-mean), "gpg", "cispo", "clip_cov", "kl_cov", or any name added
    with register_policy_loss."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of the micro-batch's response tokens whose gradient may be cut."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens with centred advantage x log-prob covariance above this are candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: ... and below this."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of the micro-batch's response tokens (largest covariance) given the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of |log pi - log pi_old| on the selected tokens."""

    def __post_init__(self):
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"policy_loss.{name} must be in (0, 1] (got {getattr(self, name)})")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"policy_loss.clip_cov_lb={self.clip_cov_lb} must be below "
                             f"policy_loss.clip_cov_ub={self.clip_cov_ub}")
        if self.ppo_kl_coef < 0:
            raise ValueError(f"policy_loss.ppo_kl_coef must be >= 0 (got {self.ppo_kl_coef})")


@dataclass
class CheckpointContentsConfig:
    """What a checkpoint of this role holds."""

    contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """Any of "model", "optimizer", "extra" (lr scheduler, RNG), "hf_model" (an HF export beside it)."""

    def __post_init__(self):
        _check_contents("checkpoint.contents", self.contents)


@dataclass
class ActorConfig(ParallelLayout):
    """The PPO policy update (`actor_rollout_ref.actor`)."""

    SECTION: ClassVar[str] = "actor_rollout_ref.actor"

    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (times rollout.n responses), over all data-parallel ranks."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Rows per forward/backward on one rank (gradient accumulation); None = the rank's whole mini-batch."""
    ppo_micro_batch_size: int | None = None
    """veRL's deprecated global form of ppo_micro_batch_size_per_gpu: rows per forward/backward over all data-parallel ranks, divided by the
    data-parallel size at start-up (as veRL does). None (default): use ppo_micro_batch_size_per_gpu; set one of the two."""
    use_dynamic_bsz: bool = False
    """Pack micro-batches by a token budget (`ppo_max_token_len_per_gpu`) instead of a row count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch when `use_dynamic_bsz` (at least prompt + response length)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (the pre-clip norm is reported as actor/grad_norm)."""
    clip_ratio: float = 0.2
    """PPO clip epsilon; the default of clip_ratio_low / clip_ratio_high."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon (ratio >= 1 - clip_ratio_low); None = clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon (ratio <= 1 + clip_ratio_high, DAPO clip-higher); None = clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip PPO: lower bound of the loss for negative advantages (must be > 1)."""
    loss_agg_mode: str = "token-mean"
    """How token losses become one number: token-mean, seq-mean-token-sum, seq-mean-token-mean,
    seq-mean-token-sum-norm (Dr. GRPO)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (loss -= entropy_coeff * entropy)."""
    use_kl_loss: bool = False
    """Add a KL(actor || ref) term to the loss (GRPO style); needs the ref policy."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss: kl|k1, abs, mse|k2, low_var_kl|k3; a trailing "+" (e.g. "k3+")
    keeps the value and takes the k2 gradient (straight-through)."""
    tis_imp_ratio_cap: float = -1.0
    """Truncated importance sampling: weight token losses by min(exp(old - rollout log-prob), cap);
    a value <= 0 turns it off."""
    ppo_epochs: int = 1
    """Passes over the batch per update."""
    shuffle: bool = False
    """Shuffle rows before splitting into mini-batches (seeded by `seed` and the update count)."""
    seed: int = 1
    """Seed of the mini-batch shuffle."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy loss."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding of the actor."""
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)
    """What actor checkpoints hold."""

    def __post_init__(self):
        self.check_layout()
        if self.ppo_mini_batch_size <= 0:
            raise ValueError(f"actor.ppo_mini_batch_size must be > 0 (got {self.ppo_mini_batch_size})")
        _check_positive_or_none("actor.ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu)
        _check_global_micro(self.SECTION, "ppo_micro_batch_size", self.ppo_micro_batch_size,
                            self.ppo_micro_batch_size_per_gpu)
        if self.ppo_max_token_len_per_gpu <= 0:
            raise ValueError("actor.ppo_max_token_len_per_gpu must be > 0")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"actor.loss_agg_mode={self.loss_agg_mode!r} is unknown; use one of {list(LOSS_AGG_MODES)}")
        if self.kl_loss_type.rstrip("+") not in KL_LOSS_TYPES:
            raise ValueError(f"actor.kl_loss_type={self.kl_loss_type!r} is unknown; use one of {list(KL_LOSS_TYPES)}")
        if self.clip_ratio_low is None:
            self.clip_ratio_low = self.clip_ratio
        if self.clip_ratio_high is None:
            self.clip_ratio_high = self.clip_ratio
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            if getattr(self, name) < 0:
                raise ValueError(f"actor.{name} must be >= 0 (got {getattr(self, name)})")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c must be > 1.0 (got {self.clip_ratio_c})")
        if self.grad_clip <= 0:
            raise ValueError(f"actor.grad_clip must be > 0 (got {self.grad_clip}); use a large value to disable")
        if self.ppo_epochs < 1:
            raise ValueError(f"actor.ppo_epochs must be >= 1 (got {self.ppo_epochs})")


@dataclass
class RefConfig(ParallelLayout):
    """The frozen reference policy (`actor_rollout_ref.ref`)."""

    SECTION: ClassVar[str] = "actor_rollout_ref.ref"

    log_prob_micro_batch_size_per_gpu: int | None = None
    """Rows per forward on one rank; None = the rank's whole batch."""
    log_prob_micro_batch_size: int | None = None
    """veRL's deprecated global form of log_prob_micro_batch_size_per_gpu: rows per forward over all data-parallel ranks, divided by the
    data-parallel size at start-up (as veRL does). None (default): use log_prob_micro_batch_size_per_gpu; set one of the two."""
    log_prob_use_dynamic_bsz: bool = False
    """Pack forward micro-batches by a token budget."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of one forward micro-batch when dynamic."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding of the reference model (parameter offload is useful: it only runs forward)."""

    def __post_init__(self):
        self.check_layout()
        _check_positive_or_none("ref.log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu)
        _check_global_micro(self.SECTION, "log_prob_micro_batch_size", self.log_prob_micro_batch_size,
                            self.log_prob_micro_batch_size_per_gpu)
        if self.log_prob_max_token_len_per_gpu <= 0:
            raise ValueError("ref.log_prob_max_token_len_per_gpu must be > 0")


@dataclass
class ActorRolloutRefConfig:
    """The `actor_rollout_ref` section: one model, trained by the actor, sampled by the rollout."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (also the reference's initial weights)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The PPO update."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The generation engine."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy."""
    hybrid_engine: bool = True
    """Actor and rollout share processes and weights (the only mode)."""

    def __post_init__(self):
        if not self.hybrid_engine:
            raise ValueError("actor_rollout_ref.hybrid_engine=False is not supported; set it to True")


@dataclass
class CriticConfig(ParallelLayout):
    """The value model and its update (`critic`)."""

    SECTION: ClassVar[str] = "critic"

    model: ModelConfig = field(default_factory=ModelConfig)
    """The causal LM the value model starts from (its backbone; the scalar head is new)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding of the critic."""
    rollout_n: int = 1
    """Responses per prompt (the trainer copies actor_rollout_ref.rollout.n)."""
    ppo_mini_batch_size: int | None = None
    """Prompts per optimizer step (times rollout_n rows), over all data-parallel ranks; None = the
    actor's actor_rollout_ref.actor.ppo_mini_batch_size (veRL's default)."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Rows per forward/backward on one rank; None = the rank's whole mini-batch."""
    ppo_micro_batch_size: int | None = None
    """veRL's deprecated global form of ppo_micro_batch_size_per_gpu: rows per forward/backward over all data-parallel ranks, divided by the
    data-parallel size at start-up (as veRL does). None (default): use ppo_micro_batch_size_per_gpu; set one of the two.
    It also sets forward_micro_batch_size when that is None (veRL's default)."""
    forward_micro_batch_size_per_gpu: int | None = None
    """Rows per forward of compute_values on one rank; None = the rank's whole batch."""
    forward_micro_batch_size: int | None = None
    """veRL's deprecated global form of forward_micro_batch_size_per_gpu: rows per forward of compute_values over all data-parallel ranks, divided by the
    data-parallel size at start-up (as veRL does). None (default): use forward_micro_batch_size_per_gpu; set one of the two."""
    use_dynamic_bsz: bool = False
    """Pack micro-batches by a token budget."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of one training micro-batch when dynamic."""
    forward_max_token_len_per_gpu: int = 32768
    """Token budget of one compute_values micro-batch when dynamic."""
    ppo_epochs: int = 1
    """Passes over the batch per update."""
    shuffle: bool = False
    """Shuffle rows before splitting into mini-batches."""
    seed: int = 1
    """Seed of the mini-batch shuffle."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (pre-clip norm reported as critic/grad_norm)."""
    cliprange_value: float = 0.5
    """Value clipping: predictions stay within +-cliprange_value of the old values."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss (same choices as the actor's)."""
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)
    """What critic checkpoints hold."""

    def __post_init__(self):
        self.check_layout()
        if self.rollout_n < 1:
            raise ValueError(f"critic.rollout_n must be >= 1 (got {self.rollout_n})")
        if self.ppo_mini_batch_size is not None and self.ppo_mini_batch_size <= 0:
            raise ValueError(f"critic.ppo_mini_batch_size must be > 0 or None (got {self.ppo_mini_batch_size})")
        _check_positive_or_none("critic.ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu)
        _check_positive_or_none("critic.forward_micro_batch_size_per_gpu", self.forward_micro_batch_size_per_gpu)
        _check_global_micro(self.SECTION, "ppo_micro_batch_size", self.ppo_micro_batch_size,
                            self.ppo_micro_batch_size_per_gpu)
        _check_global_micro(self.SECTION, "forward_micro_batch_size", self.forward_micro_batch_size,
                            self.forward_micro_batch_size_per_gpu)
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"critic.loss_agg_mode={self.loss_agg_mode!r} is unknown; use one of {list(LOSS_AGG_MODES)}")
        if self.cliprange_value <= 0:
            raise ValueError(f"critic.cliprange_value must be > 0 (got {self.cliprange_value})")
        if self.grad_clip <= 0:
            raise ValueError(f"critic.grad_clip must be > 0 (got {self.grad_clip})")
        if self.ppo_epochs < 1:
            raise ValueError(f"critic.ppo_epochs must be >= 1 (got {self.ppo_epochs})")


@dataclass
class RewardModelConfig(HasLayout):
    """A learned reward model (`reward_model`): a sequence-classification model from a local path."""

    SECTION: ClassVar[str] = "reward_model"

    enable: bool = False
    """Score responses with the reward model; the trainer adds its score to the rule-based one."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The reward model (AutoModelForSequenceClassification, num_labels=1)."""
    input_tokenizer: str | None = None
    """Tokenizer of the policy when it differs from the RM's: responses are decoded with it and
    re-encoded with the RM's chat template. None = the RM reads the policy's token ids as they are."""
    micro_batch_size_per_gpu: int | None = None
    """Rows per forward on one rank; None = the rank's whole batch."""
    micro_batch_size: int | None = None
    """veRL's deprecated global form of micro_batch_size_per_gpu: rows per forward over all data-parallel ranks, divided by the
    data-parallel size at start-up (as veRL does). None (default): use micro_batch_size_per_gpu; set one of the two."""
    max_length: int | None = None
    """Re-encoded inputs longer than this are truncated on the left (None = no limit)."""
    use_dynamic_bsz: bool = False
    """Pack forward micro-batches by a token budget."""
    forward_max_token_len_per_gpu: int = 32768
    """Token budget of one forward micro-batch when dynamic."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding of the reward model."""
    reward_manager: RewardManagerName = "naive"
    """veRL's reward manager of the rule-based / custom reward (it applies with or without a reward model):
    naive (one call per sample), batch (one call with lists; needs custom_reward_function.path), dapo
    (trailing eos text removed, overlong_buffer_cfg), prime (positional calls, a tuple's first element is
    the score). See tinyzero.rewards.manager."""
    reward_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the reward manager (veRL: reward_model.reward_kwargs): the batch function's
    extra arguments, or dapo's overlong_buffer_cfg (enable, len, penalty_factor, log) and max_resp_len."""

    def __post_init__(self):
        if not isinstance(self.reward_kwargs, dict):
            raise ValueError(f"reward_model.reward_kwargs must be a mapping, got {self.reward_kwargs!r:.100}")
        _check_positive_or_none("reward_model.micro_batch_size_per_gpu", self.micro_batch_size_per_gpu)
        _check_global_micro(self.SECTION, "micro_batch_size", self.micro_batch_size, self.micro_batch_size_per_gpu)
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"reward_model.max_length must be > 0 or None (got {self.max_length})")
