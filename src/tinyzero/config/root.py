"""The root config: composition of the component configs and the validation that spans sections.

`Config` has veRL's sections (data, actor_rollout_ref, critic, reward_model, reward, algorithm,
trainer) plus `dpo`. Each component dataclass lives next to the code it configures; this module
only composes them, adds `TrainerConfig`, and checks what spans sections. Reading and writing it
(YAML, presets, the command line) is tinyzero.config.parse.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field
from typing import Literal

from tinyzero.algorithms import ADV_ESTIMATORS, POLICY_LOSSES, get_adv_estimator_spec
from tinyzero.algorithms.config import AlgorithmConfig
from tinyzero.algorithms.distill import DistillConfig
from tinyzero.config.pipeline import PipelineConfig
from tinyzero.config.reliability import ReliabilityConfig
from tinyzero.config.tuning import TuningConfig
from tinyzero.data.config import DataConfig
from tinyzero.rewards.config import CustomRewardFunctionConfig, RewardConfig
from tinyzero.workers.config import ActorRolloutRefConfig, CriticConfig, RewardModelConfig

MODES = ("ppo", "sft", "rm", "dpo")


class ConfigError(ValueError):
    """A setting (or a combination of settings) to change; the message names it and the fix.

    Config checks are deterministic, so every rank raises the same one: train.py prints it once.
    """


@dataclass
class TrainerConfig:
    """The run itself: length, logging, validation, checkpoints (veRL: `trainer`)."""

    mode: Literal["ppo", "sft", "rm", "dpo"] = "ppo"
    """What to train: "ppo" (any RL estimator: GAE/PPO, GRPO, RLOO, ...), "sft", "rm" (Bradley-Terry
    reward model) or "dpo". `train.py sft ...` sets it from the first argument."""
    project_name: str = "tinyzero"
    """Project name (TensorBoard / W&B grouping)."""
    experiment_name: str = "run"
    """Run name (TensorBoard / W&B run)."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Loggers: any of "console", "jsonl" (metrics.jsonl in the run folder), "tensorboard", "wandb"."""
    default_local_dir: str = "runs/tinyzero"
    """The run folder: config.yaml, metrics.jsonl, samples.jsonl, checkpoints/, hf export, plots."""
    total_epochs: int = 1
    """Passes over the training data."""
    total_training_steps: int | None = None
    """Cap on training steps; None = total_epochs x batches per epoch."""
    seed: int = 1
    """Seed of everything the trainer draws (data order, sampling)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the run: "auto" takes CUDA when available."""
    n_gpus_per_node: int | None = None
    """veRL's ranks per node. torchrun decides the world (--nnodes x --nproc_per_node); when set, it is
    checked against it: n_gpus_per_node x nnodes must equal the torchrun world size. None: not checked."""
    nnodes: int | None = None
    """veRL's node count, checked with n_gpus_per_node against torchrun's world (None counts as 1)."""
    critic_warmup: int = 0
    """Steps that update only the critic before the actor starts learning (GAE only)."""
    balance_batch: bool = True
    """Reorder responses so every data-parallel rank gets about the same number of tokens."""
    test_freq: int = -1
    """Validate every this many steps (-1: only at the end)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_only: bool = False
    """Validate and exit."""
    save_freq: int = -1
    """Checkpoint every this many steps (-1: only at the end)."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """"auto": continue from the latest checkpoint in the run folder if there is one; "disable": start
    fresh; "resume_path": continue from `resume_from_path`."""
    resume_from_path: str = ""
    """Checkpoint folder to continue from with resume_mode="resume_path"."""
    max_ckpt_to_keep: int | None = None
    """Keep only this many latest checkpoints (None: keep all)."""
    export_hf: bool = True
    """Write the final actor (or the SFT/RM model) as an HF model folder to RUN/hf_model."""
    log_samples: int = 4
    """(prompt, response, score) rows written to samples.jsonl per step (0: none)."""
    log_val_generations: int = 4
    """Validation samples written to samples.jsonl at each validation."""
    rollout_data_dir: str | None = None
    """Write every training response of each step to DIR/<step>.jsonl (input, output, gts, score, step and the
    reward function's extra keys, as veRL dumps them); None: no dump."""
    validation_data_dir: str | None = None
    """Write every validation response to DIR/<step>.jsonl at each validation (as rollout_data_dir, plus the
    "reward" column); None: no dump."""
    progress_bar: bool = True
    """Show a progress bar with ETA on rank 0 (console logger)."""
    plot: bool = True
    """Draw the curves (PNG) into the run folder at the end (needs matplotlib)."""

    def __post_init__(self):
        known = ("console", "jsonl", "tensorboard", "wandb")
        if isinstance(self.logger, str):
            self.logger = [self.logger]
        for name in self.logger:
            if name not in known:
                raise ConfigError(f"trainer.logger has unknown entry {name!r}{nearest(name, known)}; "
                                 f"choose from {list(known)}")
        for name in ("total_epochs",):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name} must be >= 1 (got {getattr(self, name)})")
        if self.total_training_steps is not None and self.total_training_steps < 1:
            raise ConfigError(f"trainer.total_training_steps must be >= 1 or None (got {self.total_training_steps})")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ConfigError('trainer.resume_mode="resume_path" needs trainer.resume_from_path=<checkpoint dir>')
        if self.test_freq == 0 or self.save_freq == 0:
            raise ConfigError("trainer.test_freq / trainer.save_freq must be a positive step count or -1 (off)")
        for name in ("n_gpus_per_node", "nnodes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name} must be >= 1 or None (got {getattr(self, name)})")
        if self.critic_warmup < 0:
            raise ConfigError(f"trainer.critic_warmup must be >= 0 (got {self.critic_warmup})")


@dataclass
class DPOConfig:
    """Direct preference optimisation on a pairwise parquet (trainer.mode="dpo")."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward (larger keeps the policy nearer the reference)."""
    label_smoothing: float = 0.0
    """Conservative DPO: assumed probability that a preference label is flipped (0 <= eps < 0.5)."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """"sigmoid": the DPO loss; "ipo": identity preference optimisation (squared loss)."""

    def __post_init__(self):
        if self.beta <= 0:
            raise ConfigError(f"dpo.beta must be > 0 (got {self.beta})")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5) (got {self.label_smoothing})")


@dataclass
class Config:
    """tinyzero run configuration (veRL ppo_trainer.yaml sections)."""

    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and lengths."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """The policy: model, PPO update, rollout engine, reference."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (GAE only)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A learned reward model (optional)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rule-based reward scoring."""
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """A user reward function (veRL's custom_reward_function: path, name, reward_kwargs)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and KL control."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The run: length, logging, validation, checkpoints."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Where the roles run (one pool or split pools) and the asynchronous pipeline (staleness, partial rollouts)."""
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    """Timeouts, the hang watchdog, saving on signals, non-finite steps, resuming with a changed config."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """DPO loss settings (trainer.mode="dpo")."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a frozen teacher (off while distill.teacher_path is empty)."""
    tuning: TuningConfig = field(default_factory=TuningConfig)
    """Knobs of tinyzero's own machinery (host memory); they change speed and memory, never the results."""

    def __post_init__(self):
        apply_rollout_correction(self)
        check_config(self)

    @property
    def use_critic(self) -> bool:
        """Whether the run trains a value model (an estimator registered with needs_critic, such as gae)."""
        return self.trainer.mode == "ppo" and get_adv_estimator_spec(self.algorithm.adv_estimator).needs_critic

    @property
    def use_reference(self) -> bool:
        """Whether the run needs a frozen reference policy."""
        if self.trainer.mode == "dpo":
            return True
        return self.trainer.mode == "ppo" and (
            self.algorithm.use_kl_in_reward or self.actor_rollout_ref.actor.use_kl_loss)


# --------------------------------------------------------------------------- cross-field checks


def check_dapo(cfg: Config) -> None:
    """DAPO's settings against the rest: the overlong buffer fits the response; the filter's metric is known
    before the in-reward KL."""
    buffer = cfg.reward.overlong_buffer
    if buffer.enable and buffer.len > cfg.data.max_response_length:
        raise ConfigError(f"reward.overlong_buffer.len={buffer.len} exceeds data.max_response_length="
                          f"{cfg.data.max_response_length}; set a buffer of at most the response length")
    fg = cfg.algorithm.filter_groups
    if fg.enable and cfg.actor_rollout_ref.rollout.n == 1:
        warnings.warn("algorithm.filter_groups.enable=true with actor_rollout_ref.rollout.n=1: a group of one sample "
                      "is always kept, so nothing is filtered; set n >= 2", stacklevel=3)
    if fg.enable and fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.filter_groups.metric=seq_final_reward cannot see the in-reward KL (it needs the "
                          "log-prob passes, which run on the kept groups only); use metric=seq_reward, or "
                          "algorithm.use_kl_in_reward=false")


def check_lora(cfg: Config) -> None:
    """LoRA trains the PPO-family actor only (the reference is its base; see tinyzero.models.lora)."""
    if cfg.critic.model.lora_rank:
        raise ConfigError(f"critic.model.lora_rank={cfg.critic.model.lora_rank}: LoRA applies to the actor only; "
                          "set critic.model.lora_rank=0")
    if cfg.actor_rollout_ref.model.lora_rank and cfg.trainer.mode != "ppo":
        raise ConfigError(f"actor_rollout_ref.model.lora_rank with trainer.mode={cfg.trainer.mode!r}: LoRA is "
                          "supported for PPO-family runs (trainer.mode=ppo); set lora_rank=0")


def check_distill(cfg: Config) -> None:
    """Where the teacher and an in-process judge may run: distillation in the synchronous PPO-family loop
    (tinyzero.algorithms.distill), a pool of their own only under a split placement."""
    t = cfg.pipeline
    if cfg.distill.enabled and (t.max_staleness or t.rollout_pool_size):
        raise ConfigError("distill.teacher_path with the asynchronous pipeline (pipeline.max_staleness / "
                          "rollout_pool_size) is not supported; set both to 0, or distill.teacher_path=''")
    judge = cfg.reward.judge
    if judge.enable and judge.pool == "split" and (t.placement != "split" or judge.url or judge.engine == "vllm"):
        raise ConfigError("reward.judge.pool=split loads an in-process judge (reward.judge.model_path, engine native "
                          "or hf) on the second pool of pipeline.placement=split only; set pipeline.placement=split, "
                          "or reward.judge.pool=all")
    if cfg.distill.enabled and cfg.distill.teacher_pool == "split" and t.placement != "split":
        raise ConfigError("distill.teacher_pool=split runs the teacher on the second pool of a split placement; "
                          "set pipeline.placement=split (and pipeline.actor_pool_size), or distill.teacher_pool=policy")


def check_async(cfg: Config) -> None:
    """The asynchronous pipeline (pipeline.max_staleness / rollout_pool_size; see trainer.async_pipeline)."""
    t, arr = cfg.pipeline, cfg.actor_rollout_ref
    if t.partial_rollout and not t.max_staleness:
        raise ConfigError("pipeline.partial_rollout=true continues generations across weight updates, which "
                          "happen during generation only with pipeline.max_staleness >= 1; set max_staleness=1 "
                          "or partial_rollout=false")
    if not (t.max_staleness or t.rollout_pool_size):
        if t.rollout_rs_threshold:
            raise ConfigError(f"pipeline.rollout_rs_threshold={t.rollout_rs_threshold} applies to the asynchronous "
                              "pipeline only; set pipeline.max_staleness >= 1 or rollout_rs_threshold=0")
        return
    what = f"pipeline.max_staleness={t.max_staleness}, pipeline.rollout_pool_size={t.rollout_pool_size}"
    if arr.rollout.name == "vllm":
        raise ConfigError(f"{what}: vLLM (external_launcher) needs every rank of the world, but the pipeline runs "
                          "the rollout on its own pool; set actor_rollout_ref.rollout.name=native")
    if t.placement != "colocate":
        raise ConfigError(f"{what}: the pipeline splits rollout and training itself (actor, reference and critic "
                          "share the trainer pool); leave pipeline.placement=colocate")
    if t.rollout_rs_threshold and (t.rollout_rs_threshold <= 1 or arr.rollout.use_rollout_log_probs):
        raise ConfigError(f"pipeline.rollout_rs_threshold={t.rollout_rs_threshold}: set a value > 1 (e.g. 2.0), and "
                          "leave actor_rollout_ref.rollout.use_rollout_log_probs=false (the ratio compares the "
                          "trainer's old policy with the rollout policy; bypass mode makes them one)")
    corrected = arr.actor.tis_imp_ratio_cap > 0 or arr.rollout.use_rollout_log_probs or t.rollout_rs_threshold > 0
    if t.max_staleness and not corrected and not t.allow_uncorrected_staleness:
        raise ConfigError(f"pipeline.max_staleness={t.max_staleness} trains on samples of an older policy: set "
                          "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0 (truncated importance sampling) or "
                          "actor_rollout_ref.rollout.use_rollout_log_probs=true (the rollout policy as the PPO old "
                          "policy), or pipeline.allow_uncorrected_staleness=true to train without a correction")
    unsupported = {"algorithm.filter_groups.enable": cfg.algorithm.filter_groups.enable,
                   "actor_rollout_ref.model.lora_rank": arr.model.lora_rank,
                   f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} (a greedy baseline rollout)":
                       getattr(ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator), "needs_baseline", False)}
    for name, value in unsupported.items():
        if value:
            raise ConfigError(f"{what}: {name} is not supported by the asynchronous pipeline; turn it off or "
                              "set pipeline.max_staleness=0 and pipeline.rollout_pool_size=0")


def apply_rollout_correction(cfg: Config) -> None:
    """veRL's algorithm.rollout_correction onto tinyzero's settings (see RolloutCorrectionConfig)."""
    from tinyzero.config.overrides import override

    rc, arr = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref
    why = "algorithm.rollout_correction sets it"
    if rc.rollout_is == "token":
        override(arr.actor, "tis_imp_ratio_cap", rc.rollout_is_threshold, "actor_rollout_ref.actor.tis_imp_ratio_cap",
                 why)
    if rc.rollout_rs == "seq_mean_k1":
        override(cfg.trainer, "rollout_rs_threshold", rc.rollout_rs_threshold, "pipeline.rollout_rs_threshold", why)
    if rc.bypass_mode:
        override(arr.rollout, "use_rollout_log_probs", True, "actor_rollout_ref.rollout.use_rollout_log_probs", why)


def check_config(cfg: Config) -> None:
    """Checks that need no world size (run when the config is built)."""
    arr = cfg.actor_rollout_ref
    check_lora(cfg)
    if cfg.trainer.mode != "ppo":
        return
    n = arr.rollout.n
    estimator = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if estimator is None:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} is unknown; use one of "
                         f"{sorted(ADV_ESTIMATORS)} or register one with register_adv_est")
    if estimator.needs_groups and n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} compares responses within a "
                         f"group: set actor_rollout_ref.rollout.n >= 2 (got {n})")
    if estimator.needs_groups and n > 1 and not arr.rollout.do_sample:
        warnings.warn(f"actor_rollout_ref.rollout.do_sample=false with n={n}: greedy rollouts give {n} identical "
                      f"samples per prompt, so {cfg.algorithm.adv_estimator}'s group advantages are all 0; set "
                      "do_sample=true to train on them", stacklevel=2)
    check_dapo(cfg)
    check_async(cfg)
    check_distill(cfg)
    if arr.actor.policy_loss.loss_mode not in POLICY_LOSSES:
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.loss_mode={arr.actor.policy_loss.loss_mode!r} is "
                         f"unknown; use one of {sorted(POLICY_LOSSES)} or register one with register_policy_loss")
    required_agg = POLICY_LOSSES[arr.actor.policy_loss.loss_mode].loss_agg_mode
    if required_agg is not None and arr.actor.loss_agg_mode != required_agg:
        # Such a loss aggregates its own way; the micro-batch weights follow loss_agg_mode.
        raise ConfigError(f"policy_loss.loss_mode={arr.actor.policy_loss.loss_mode!r} aggregates with "
                         f"{required_agg}: set actor_rollout_ref.actor.loss_agg_mode={required_agg} "
                         f"(got {arr.actor.loss_agg_mode!r})")
    # ppo_mini_batch_size against the batch and the layouts: the run plan (tinyzero.plan)


def check_model_context(cfg: Config, max_position_embeddings: int) -> None:
    """Prompt + response must fit the model's context window."""
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    if total > max_position_embeddings:
        raise ConfigError(f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's "
                         f"max_position_embeddings={max_position_embeddings}; lower one of them")


# --------------------------------------------------------------------------- dict / YAML round trip


def nearest(name: str, choices) -> str:
    """A hint naming the setting the user probably meant: the one setting with the same last name (a
    setting that moved between sections), else the closest spelling."""
    choices = list(choices)
    leaf = name.rsplit(".", 1)[-1]
    moved = [c for c in choices if c.rsplit(".", 1)[-1] == leaf and c != name]
    close = moved if len(moved) == 1 else difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""
