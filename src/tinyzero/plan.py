"""The run plan: what a run derives from the user's config and the world, computed and checked once.

    plan = plan_run(cfg, world_size)       # every rank, after init_distributed(); before any role starts
    plan = with_model(plan, hf_config)     # checked against the policy model (context, heads)
    plan.config                            # what the roles run: a copy of the user's config with the
                                           # derived values filled in (lengths, the critic's sizes, ...)
    plan.pools["critic"]                   # each role's ranks
    plan.dims["actor"]                     # each role's ParallelDims
    plan.rows_per_mini_batch["actor"]      # rows per data-parallel rank per PPO mini-batch
    plan.engine                            # what rollout.name="auto" resolved to (said once, on rank 0)

Every layout and batch-size check runs here, with the setting to change in its message; the trainers
and workers receive what they need from the plan and rebuild nothing. The user's config object is
never written: config.yaml in the run folder holds what the user asked for, plan.yaml beside it
what the run derived from it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tinyzero.config import Config, ConfigError, TrainerConfig, check_config, check_model_context
from tinyzero.distributed.parallel_dims import LayoutError, ParallelDims
from tinyzero.workers.config import policy_layouts, role_layout

__all__ = ["RunPlan", "plan_run", "with_model"]


@dataclass(frozen=True)
class RunPlan:
    """Everything derived from the user's config and the world size (see the module docstring)."""

    world_size: int
    config: Config
    """The config the roles run: the user's, with the derived values filled in (never the user's object)."""
    pools: dict[str, tuple[int, ...]]
    """Role -> the global ranks of its pool ("actor" also holds the rollout and the reference unless the
    asynchronous pipeline gives the rollout a pool of its own)."""
    dims: dict[str, ParallelDims]
    """Role -> its layout on its pool (only the roles the run uses)."""
    rows_per_mini_batch: dict[str, int] = field(default_factory=dict)
    """Trained role -> rows each data-parallel rank takes per PPO mini-batch (prompts x rollout.n / dp)."""
    engine: str = "native"
    """The rollout engine ("auto" resolved)."""
    asynchronous: bool = False
    """The rollout runs on its own pool, ahead of training (pipeline.max_staleness / rollout_pool_size)."""
    hf_config: Any = None
    """The policy model's HF config (None when planned without reading the model)."""
    fast_path: dict[str, Any] = field(default_factory=dict)
    """The settings the user left unset (None) and the plan chose, by dotted key (see choose_fast_path)."""

    def summary(self) -> dict:
        """What the run derived, as plain values (written to plan.yaml in the run folder)."""
        return {"world_size": self.world_size, "engine": self.engine, "asynchronous": self.asynchronous,
                "pools": {k: list(v) for k, v in self.pools.items()},
                "dims": {k: {"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp, "sp": d.sp}
                         for k, d in self.dims.items()},
                "rows_per_mini_batch": dict(self.rows_per_mini_batch), "fast_path": dict(self.fast_path)}


def plan_run(cfg: Config, world_size: int, notice=print) -> RunPlan:
    """The plan of `cfg` on `world_size` ranks; raises ConfigError naming the setting to change.
    `notice` gets the one line saying what rollout.name="auto" chose (None: silent). `with_model` then
    checks the plan against the model."""
    resolved = copy.deepcopy(cfg)
    engine = _resolve_engine(resolved, notice)
    sync_derived_fields(resolved)
    check_gpus_per_node(resolved.trainer, world_size)
    check_mini_batches(resolved)
    if cfg.trainer.mode != "ppo":
        return _plan_supervised(resolved, world_size)
    arr = resolved.actor_rollout_ref
    if arr.rollout.name == "vllm" and resolved.pipeline.placement != "colocate":
        raise ConfigError("actor_rollout_ref.rollout.name='vllm' runs one engine on every rank of the torchrun "
                          "world; set pipeline.placement=colocate (or rollout.name=native for a split placement)")
    asynchronous = bool(resolved.pipeline.max_staleness or resolved.pipeline.rollout_pool_size)
    fast_path = choose_fast_path(resolved, engine, asynchronous, world_size)
    _say_fast_path(fast_path, notice)
    if asynchronous:
        policy, rollout = _async_pools(resolved, world_size)
        others = policy
    else:
        actor_size, _ = pool_sizes(resolved, world_size)
        policy = rollout = tuple(range(actor_size))
        others = policy if resolved.pipeline.placement == "colocate" else tuple(range(actor_size, world_size))
    pools: dict[str, tuple[int, ...]] = {"actor": policy, "rollout": rollout}
    n, responses = arr.rollout.n, resolved.data.train_batch_size * arr.rollout.n
    what = "data.train_batch_size x rollout.n responses"
    try:
        dims = policy_layouts(arr, len(policy), "actor_ref" if resolved.use_reference else "actor")
        dims["rollout"] = policy_layouts(arr, len(rollout), "rollout")["rollout"]
        if resolved.use_critic:
            pools["critic"] = others
            dims["critic"] = role_layout(resolved.critic, len(others))
        if resolved.reward_model.enable:
            pools["reward_model"] = others
            dims["reward_model"] = role_layout(resolved.reward_model, len(others))
        if resolved.distill.enabled:  # laid out like the reference model, on its pool or the split one
            pools["teacher"] = others if resolved.distill.teacher_pool == "split" else policy
            dims["teacher"] = role_layout(arr.ref, len(pools["teacher"]))
        convert_global_micro_batches(resolved, dims)
        rows = {"actor": dims["actor"].rows_per_rank(arr.actor.ppo_mini_batch_size, n,
                                                     arr.actor.ppo_micro_batch_size_per_gpu, arr.actor.use_dynamic_bsz)}
        for role in ("actor", "ref", "critic", "teacher"):
            if role in dims:
                dims[role].check_rows(responses, what, "data.train_batch_size")
        if resolved.use_critic:
            critic = resolved.critic
            rows["critic"] = dims["critic"].rows_per_rank(critic.ppo_mini_batch_size, n,
                                                          critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if resolved.use_reference:
        pools["ref"] = policy
    return RunPlan(world_size=world_size, config=resolved, pools=pools, dims=dims, rows_per_mini_batch=rows,
                   engine=engine, asynchronous=asynchronous, fast_path=fast_path)


def _plan_supervised(resolved: Config, world_size: int) -> RunPlan:
    """SFT, RM and DPO: one trained model on every rank, laid out by the actor's settings (and DPO's
    frozen reference by the reference's)."""
    fast_path = choose_fast_path(resolved, resolved.actor_rollout_ref.rollout.name, False, world_size)
    try:
        if resolved.trainer.mode == "dpo":  # the reference model beside the actor
            dims = policy_layouts(resolved.actor_rollout_ref, world_size, "actor_ref")
        else:
            dims = {"actor": role_layout(resolved.actor_rollout_ref.actor, world_size)}
        convert_global_micro_batches(resolved, dims)
        dims["actor"].check_rows(resolved.data.train_batch_size, "data.train_batch_size", "data.train_batch_size")
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if dims["actor"].tp > 1 or dims["actor"].sp > 1:
        raise ConfigError(f"trainer.mode={resolved.trainer.mode} trains data-parallel only; set "
                          "actor_rollout_ref.actor.tensor_model_parallel_size and ulysses_sequence_parallel_size "
                          "to 1 (tensor and sequence parallelism apply to the PPO roles)")
    if resolved.trainer.mode == "dpo":
        _check_dpo(resolved, world_size)
    return RunPlan(world_size=world_size, config=resolved, pools={"actor": tuple(range(world_size))}, dims=dims,
                   engine=resolved.actor_rollout_ref.rollout.name, fast_path=fast_path)


def _check_dpo(resolved: Config, world_size: int) -> None:
    """DPO's pairs must stay whole inside every rank's chunk, mini-batch and micro-batch."""
    arr = resolved.actor_rollout_ref
    actor = arr.actor
    if arr.ref.tensor_model_parallel_size > 1 or arr.ref.ulysses_sequence_parallel_size > 1:
        raise ConfigError("trainer.mode=dpo trains data-parallel only; set actor_rollout_ref.ref."
                          "tensor_model_parallel_size and actor_rollout_ref.ref.ulysses_sequence_parallel_size to 1")
    pairs = actor.ppo_mini_batch_size
    if resolved.data.train_batch_size % pairs:
        raise ConfigError(f"data.train_batch_size={resolved.data.train_batch_size} must be a multiple of "
                          f"actor_rollout_ref.actor.ppo_mini_batch_size={pairs} (pairs per optimizer step)")
    if pairs % world_size:
        raise ConfigError(f"actor_rollout_ref.actor.ppo_mini_batch_size={pairs} pairs must split over the "
                          f"{world_size} ranks; make it a multiple of {world_size}")
    micro = actor.ppo_micro_batch_size_per_gpu
    if micro is not None and micro % 2:
        raise ConfigError(f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} must be even for DPO "
                          "(a chosen and a rejected row per pair)")
    if actor.use_dynamic_bsz or actor.shuffle:
        raise ConfigError("DPO keeps chosen/rejected rows adjacent: set actor_rollout_ref.actor.use_dynamic_bsz "
                          "and actor_rollout_ref.actor.shuffle to false")


def _resolve_engine(resolved: Config, notice) -> str:
    """rollout.name="auto" -> the engine this machine runs (said once by `notice`)."""
    rollout = resolved.actor_rollout_ref.rollout
    if rollout.name != "auto" or resolved.trainer.mode != "ppo":
        return rollout.name
    from tinyzero.distributed import get_rank
    from tinyzero.rollout.registry import resolve_auto

    say = notice if get_rank() == 0 else None
    if resolved.trainer.device == "cpu":  # the GPU a host may have is not the run's
        rollout.name = "native"
        if say is not None:
            say("rollout.name=auto -> native (trainer.device=cpu)")
    else:
        rollout.name = resolve_auto(say)
    check_config(resolved)  # the checks that depend on the engine, now that it is known
    return rollout.name


def runs_on_cpu(cfg: Config) -> bool:
    """Whether the run computes on the CPU: trainer.device=cpu, or auto on a host without a GPU."""
    from tinyzero.distributed import device_type

    return cfg.trainer.device == "cpu" or (cfg.trainer.device == "auto" and device_type() == "cpu")


def choose_fast_path(resolved: Config, engine: str, asynchronous: bool, world_size: int = 1) -> dict[str, Any]:
    """Fill in the speed settings the user left unset (None), each on where it is measured to pay and
    exact (bench/vs_trl.py --defaults against the tuned settings; bench/RESULTS.md), off elsewhere: on
    GPU hosts, where none has been measured yet, every one stays off and the sleep level at 1. A value
    the user set is kept as written. Returns what was chosen, by dotted key (plan.yaml shows it).

    On the CPU, for PPO-family runs:
      model.use_shared_prefix     when rollout.n > 1: each group's prompt is computed once in training
      model.use_remove_padding    packed training passes, no compute on padding
      model.use_fused_layers      less kept for backward; not with tensor parallelism or LoRA
      rollout.sleep_level = 2     the native engine colocated with the actor frees its weight copy for the
                                  update (the trainer re-sends them all); not with LoRA (its sync carries
                                  the adapters only) nor with a rollout pool of its own
      rollout.tensor_model_parallel_size = the policy pool's size
                                  the native engine decodes the batch over every rank of a one-host pool
                                  (each reads 1/T of the MLP and lm_head weights per token); not with the
                                  agent loop (its tools would run T times), a compiled decode step, unmerged
                                  LoRA adapters or a rollout pool of its own. `with_model` takes it back
                                  to 1 for a model the fused decoder cannot split.
      rollout.request_seeds       vLLM requests carry their own seeds (samples independent of the batch);
                                  on GPU hosts off, where vLLM would draw seeded rows one at a time
    The critic's packing follows the same rules. Elsewhere (GPU hosts, other engines) the tensor-parallel
    degree is 1."""
    chosen: dict[str, Any] = {}

    def pick(section: Any, key: str, name: str, value: Any) -> None:
        if getattr(section, name) is None:
            setattr(section, name, value)
            chosen[f"{key}.{name}"] = value

    arr = resolved.actor_rollout_ref
    cpu = runs_on_cpu(resolved)
    ppo = resolved.trainer.mode == "ppo"
    grouped = ppo and arr.rollout.n > 1
    lora = bool(arr.model.lora_rank)
    for key, model in (("actor_rollout_ref.model", arr.model), ("critic.model", resolved.critic.model)):
        pick(model, key, "use_shared_prefix", cpu and grouped)
        pick(model, key, "use_remove_padding", cpu and ppo)
    tensor_parallel = max(arr.actor.tensor_model_parallel_size, arr.ref.tensor_model_parallel_size) > 1
    pick(arr.model, "actor_rollout_ref.model", "use_fused_layers", cpu and ppo and not tensor_parallel and not lora)
    pick(resolved.critic.model, "critic.model", "use_fused_layers", False)
    colocated_native = engine == "native" and not asynchronous and arr.rollout.free_cache_engine
    pick(arr.rollout, "actor_rollout_ref.rollout", "sleep_level", 2 if cpu and ppo and colocated_native and not lora
         else 1)
    pick(arr.rollout, "actor_rollout_ref.rollout", "tensor_model_parallel_size",
         _rollout_tp(resolved, world_size) if cpu and ppo and engine == "native" and not asynchronous else 1)
    pick(arr.rollout, "actor_rollout_ref.rollout", "request_seeds", cpu)
    return chosen


def _rollout_tp(resolved: Config, world_size: int) -> int:
    """The native engine's tensor-parallel degree on CPU: the whole policy pool when it is on one host."""
    import os

    rollout, model = resolved.actor_rollout_ref.rollout, resolved.actor_rollout_ref.model
    if rollout.multi_turn.enable or rollout.native_compile or rollout.native_impl == "hf" or (
            model.lora_rank and not rollout.lora_merge):
        return 1
    pool = world_size if resolved.pipeline.placement == "colocate" else pool_sizes(resolved, world_size)[0]
    one_host = pool <= int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return pool if pool > 1 and one_host else 1


def _say_fast_path(chosen: dict[str, Any], notice) -> None:
    """One line on rank 0 naming the speed settings the plan turned on (each can be set to override)."""
    from tinyzero.distributed import get_rank

    on = [f"{key.rsplit('.', 2)[-2]}.{key.rsplit('.', 1)[-1]}={str(v).lower()}" for key, v in chosen.items()
          if (v is True or (not isinstance(v, bool) and v > 1)) and not key.startswith("critic.") and not key.endswith("request_seeds")]
    if on and notice is not None and get_rank() == 0:
        notice(f"speed settings for this machine: {', '.join(on)} (set any of them to override)")


def _async_pools(resolved: Config, world_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(trainer pool, rollout pool) of the asynchronous pipeline: the rollout pool is the last ranks."""
    size = resolved.pipeline.rollout_pool_size or world_size // 2
    if not 0 < size < world_size:
        raise ConfigError(f"pipeline.rollout_pool_size={resolved.pipeline.rollout_pool_size} must leave ranks for the "
                          f"trainer pool (1..{world_size - 1}) with {world_size} ranks; the pipeline needs >= 2 ranks")
    try:
        rollout = policy_layouts(resolved.actor_rollout_ref, size, "rollout")["rollout"]
        rollout.check_rows(resolved.data.train_batch_size, f"data.train_batch_size on pipeline.rollout_pool_size="
                           f"{size} ranks", "data.train_batch_size")
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    trainer = world_size - size
    return tuple(range(trainer)), tuple(range(trainer, world_size))


def with_model(plan: RunPlan, hf_config: Any) -> RunPlan:
    """The plan checked against the policy model's HF config, which it then carries: the context window
    holds prompt + response, and each trained or reference role's tensor / sequence parallel degrees
    split the model's heads and sizes (the critic starts from the same model)."""
    _check_model(plan.config, hf_config, plan.dims)
    plan = _split_decode_or_not(plan, hf_config)
    return dataclasses.replace(plan, hf_config=hf_config)


def _split_decode_or_not(plan: RunPlan, hf_config: Any) -> RunPlan:
    """A rollout tensor-parallel degree the plan chose (not the user) goes back to 1 when the fused decoder
    cannot split this model's MLP evenly (it would then decode the whole batch on every rank alone)."""
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    tp = plan.fast_path.get(key, 1)
    if tp <= 1:
        return plan
    from tinyzero.models.families import family_of

    intermediate = getattr(hf_config, "intermediate_size", None)
    if family_of(hf_config).fused_decoder and intermediate and intermediate % tp == 0:
        return plan
    rollout = plan.config.actor_rollout_ref.rollout
    rollout.tensor_model_parallel_size = 1
    dims = dict(plan.dims)
    dims["rollout"] = policy_layouts(plan.config.actor_rollout_ref, len(plan.pools["rollout"]), "rollout")["rollout"]
    return dataclasses.replace(plan, dims=dims, fast_path={**plan.fast_path, key: 1})


def _check_model(resolved: Config, hf_config: Any, dims: dict[str, ParallelDims]) -> None:
    from tinyzero.models.tensor_parallel import check_tensor_parallel
    from tinyzero.models.ulysses import check_heads

    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_pos:
        check_model_context(resolved, int(max_pos))
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for role in ("actor", "ref", "critic"):
        d = dims.get(role)
        if d is None:
            continue
        try:
            check_tensor_parallel(hf_config, d.tp, f"{d.section}.tensor_model_parallel_size")
            if d.sp > 1:
                check_heads(heads // d.tp, max(kv_heads // d.tp, 1), d.sp)
        except ValueError as e:
            raise ConfigError(f"{d.section}: {e}") from None


# --------------------------------------------------------------------------- the rules


def check_mini_batches(cfg: Config) -> None:
    """ppo_mini_batch_size (prompts per optimizer step) divides data.train_batch_size, for the actor and, with
    a critic, the critic."""
    if cfg.trainer.mode != "ppo":
        return
    minis = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.ppo_mini_batch_size)]
    minis += [("critic", cfg.critic.ppo_mini_batch_size)] * cfg.use_critic
    for section, mini in minis:
        if cfg.data.train_batch_size < mini:
            raise ConfigError(f"{section}.ppo_mini_batch_size={mini} exceeds data.train_batch_size="
                              f"{cfg.data.train_batch_size}; lower the mini-batch size")
        if cfg.data.train_batch_size % mini:
            raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} must be a multiple of "
                              f"{section}.ppo_mini_batch_size={mini}")


def critic_mini_batch_size(cfg: Config) -> int:
    """critic.ppo_mini_batch_size, or the actor's when unset (veRL's default)."""
    return cfg.critic.ppo_mini_batch_size or cfg.actor_rollout_ref.actor.ppo_mini_batch_size


def sync_derived_fields(cfg: Config) -> Config:
    """Copy the values one section derives from another (veRL does this with ${...} interpolation)."""
    from tinyzero.config.overrides import override

    arr = cfg.actor_rollout_ref
    override(arr.rollout, "prompt_length", cfg.data.max_prompt_length, "actor_rollout_ref.rollout.prompt_length",
             "it follows data.max_prompt_length (set that instead)")
    override(arr.rollout, "response_length", cfg.data.max_response_length, "actor_rollout_ref.rollout.response_length",
             "it follows data.max_response_length (set that instead)")
    override(cfg.critic, "rollout_n", arr.rollout.n, "critic.rollout_n", "it follows actor_rollout_ref.rollout.n")
    cfg.critic.ppo_mini_batch_size = critic_mini_batch_size(cfg)
    # veRL's default: the rollout's log-prob pass batches like the actor's update unless set apart.
    if arr.actor.use_dynamic_bsz and not arr.rollout.log_prob_use_dynamic_bsz:
        arr.rollout.log_prob_use_dynamic_bsz = True
        override(arr.rollout, "log_prob_max_token_len_per_gpu", arr.actor.ppo_max_token_len_per_gpu,
                 "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                 "the log-prob pass batches like the dynamic actor update unless "
                 "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true sets it apart")
    if not cfg.critic.model.path:
        cfg.critic.model.path = arr.model.path
    if not cfg.critic.model.tokenizer_path:
        cfg.critic.model.tokenizer_path = arr.model.tokenizer_path
    return cfg


def check_gpus_per_node(trainer: TrainerConfig, world_size: int) -> None:
    """veRL's trainer.n_gpus_per_node x trainer.nnodes must be the world torchrun started."""
    if trainer.n_gpus_per_node is None and trainer.nnodes is None:
        return
    nnodes = trainer.nnodes or 1
    if trainer.n_gpus_per_node is None:
        if world_size % nnodes:
            raise ConfigError(f"trainer.nnodes={nnodes} does not divide the torchrun world of {world_size} ranks; "
                              f"launch with torchrun --nnodes {nnodes}, or set trainer.nnodes to the node count")
        return
    want = trainer.n_gpus_per_node * nnodes
    if want != world_size:
        raise ConfigError(f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} x trainer.nnodes={nnodes} = {want} "
                          f"ranks, but torchrun started {world_size}; launch with torchrun --nnodes {nnodes} "
                          f"--nproc_per_node {trainer.n_gpus_per_node}, or set trainer.n_gpus_per_node and "
                          f"trainer.nnodes to match the torchrun world")


def convert_global_micro_batches(cfg: Config, dims: dict[str, ParallelDims]) -> None:
    """veRL's deprecated global micro-batch sizes become the per-GPU ones, divided by the role's data-parallel
    size as veRL's workers divide them at start-up (the global field is then cleared)."""
    from tinyzero.config.overrides import override

    arr, critic = cfg.actor_rollout_ref, cfg.critic
    if critic.ppo_micro_batch_size is not None and critic.forward_micro_batch_size is None \
            and critic.forward_micro_batch_size_per_gpu is None:
        critic.forward_micro_batch_size = critic.ppo_micro_batch_size  # veRL's interpolation
    # The rollout's log-prob pass runs on the actor's layout.
    jobs = [(arr.actor, "ppo_micro_batch_size", "actor", "actor_rollout_ref.actor"),
            (arr.rollout, "log_prob_micro_batch_size", "actor", "actor_rollout_ref.rollout"),
            (arr.ref, "log_prob_micro_batch_size", "ref", "actor_rollout_ref.ref"),
            (critic, "ppo_micro_batch_size", "critic", "critic"),
            (critic, "forward_micro_batch_size", "critic", "critic"),
            (cfg.reward_model, "micro_batch_size", "reward_model", "reward_model")]
    for section, name, role, where in jobs:
        value = getattr(section, name)
        if value is None:
            continue
        dp = dims.get(role, dims["actor"]).dp_size  # a role the run does not use: converted on the actor's
        if value < dp:
            raise ConfigError(f"{where}.{name}={value} (global) is less than one row for each of the {dp} "
                              f"data-parallel ranks; set {where}.{name}_per_gpu instead (e.g. 1)")
        override(section, f"{name}_per_gpu", value // dp, f"{where}.{name}_per_gpu",
                 f"{where}.{name}={value} (veRL's global form) divided by {dp} data-parallel ranks")
        setattr(section, name, None)


def pool_sizes(cfg: Config, world_size: int) -> tuple[int, int]:
    """(actor pool size, critic pool size) for the placement."""
    if cfg.pipeline.placement == "colocate":
        return world_size, world_size
    if world_size < 2:
        raise ConfigError('pipeline.placement="split" needs at least 2 ranks; use "colocate" or more ranks')
    actor = cfg.pipeline.actor_pool_size or world_size // 2
    if not 0 < actor < world_size:
        raise ConfigError(f"pipeline.actor_pool_size={cfg.pipeline.actor_pool_size} must leave ranks for the critic "
                         f"(1..{world_size - 1}) with {world_size} ranks")
    return actor, world_size - actor
