"""veRL's config keys on tinyzero's config: what each key a veRL or TinyZero script passes becomes.

`resolve_key(path, value)` is called for every key the command line or a YAML file sets (after
Hydra's `+` / `++` prefixes are stripped). A key that is a tinyzero field passes through unchanged;
a veRL key is renamed onto the tinyzero field with the same meaning, ignored with one line saying
why (a Ray-only key, an engine hint this engine has no use for), or refused with one line naming
it and the nearest supported setting (a key that changes the math and that tinyzero does not
implement). A refused key is still accepted when its value is veRL's default, or what tinyzero does
anyway: scripts pass defaults explicitly.

The table `KEYS` holds one `Rule` per key, or per prefix (`ray_kwargs.*`: the key itself and
everything under it); docs/verl.md is the same table for users. A key that is neither a tinyzero
field nor in the table passes through unchanged, so the config reader reports it as unknown.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tinyzero.config.verl_values import (
    config_error,
    dtype_to,
    hdfs,
    load_contents,
    nccl_timeout,
    null_as,
    reward_manager,
    rollout_name,
    strategy,
    unless_null,
)

__all__ = ["KEYS", "Rule", "resolve_key"]


@dataclass(frozen=True)
class Rule:
    """What one veRL key (or every key under a prefix) becomes."""

    action: Literal["rename", "convert", "ignore", "refuse"]
    """rename: set `to` (a prefix rule: `to` replaces the prefix); convert: `convert(value)` gives the
    pairs; ignore: warn once with `why` and set nothing; refuse: raise with `why` and `nearest`,
    unless the value is one of `accept` (then nothing is set, silently)."""
    why: str = ""
    """The reason, as users read it (docs/verl.md shows it too)."""
    to: str = ""
    """rename: the tinyzero key."""
    nearest: str = ""
    """refuse: the nearest supported setting."""
    accept: tuple = ()
    """refuse: values that are veRL's default or what tinyzero does anyway."""
    convert: Callable[[Any], list[tuple[str, Any]]] | None = None
    """convert: value -> the (tinyzero key, value) pairs."""


def _rename(to: str, why: str = "") -> Rule:
    return Rule("rename", why=why, to=to)


def _ignore(why: str) -> Rule:
    return Rule("ignore", why=why)


def _refuse(why: str, nearest: str, *accept) -> Rule:
    return Rule("refuse", why=why, nearest=nearest, accept=accept)


def _convert(fn: Callable[[Any], list[tuple[str, Any]]], why: str) -> Rule:
    return Rule("convert", why=why, convert=fn)


# --------------------------------------------------------------------------- the table

ACTOR, REF, ROLLOUT, MODEL = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout",
                              "actor_rollout_ref.model")
RAY = "a Ray setting; tinyzero runs under torchrun without Ray"
PERF = "a speed / memory hint of veRL's engine that tinyzero's own engine does not have; the math is the same"
PROFILE = "profiling; use torch's profiler or bench/ instead"
FOLLOWS = "veRL derives it from another key; tinyzero derives the same value itself"

KEYS: dict[str, Rule] = {
    # ---- Ray, profiling, placement
    "ray_kwargs.*": _ignore(RAY),
    "ray_init.*": _ignore(RAY),
    "trainer.ray_wait_register_center_timeout": _ignore(RAY),
    "global_profiler.*": _ignore(PROFILE),
    "transfer_queue.*": _ignore("used with transfer_queue.enable only"),
    "transfer_queue.enable": _refuse("veRL's TransferQueue data system has no counterpart",
                                     "transfer_queue.enable=false", False, None),
    "trainer.default_hdfs_dir": _convert(hdfs, "null accepted; checkpoints go to trainer.default_local_dir only"),
    "trainer.del_local_ckpt_after_load": _refuse("tinyzero keeps the checkpoint it resumed from",
                                                 "trainer.del_local_ckpt_after_load=false", False),
    "trainer.esi_redundant_time": _ignore("an elastic-server-instance (ESI) deadline; tinyzero saves on SIGTERM "
                                          "instead (reliability.save_on_signal)"),
    "trainer.use_legacy_worker_impl": _ignore("picks between veRL's worker implementations; tinyzero has one"),
    "trainer.max_actor_ckpt_to_keep": _rename("trainer.max_ckpt_to_keep",
                                              "actor and critic are saved in one step folder, kept together"),
    "trainer.max_critic_ckpt_to_keep": _rename("trainer.max_ckpt_to_keep",
                                               "actor and critic are saved in one step folder, kept together"),
    "actor_rollout_ref.nccl_timeout": _convert(nccl_timeout, "the timeout of every collective, in seconds"),
    # ---- tinyzero keys that veRL's YAML sets to null where tinyzero has a value
    f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": _convert(unless_null(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"),
                                                             "null: tinyzero's default"),
    f"{MODEL}.tokenizer_path": _convert(null_as(f"{MODEL}.tokenizer_path", ""), "null: the model's folder"),
    "critic.model.tokenizer_path": _convert(null_as("critic.model.tokenizer_path", ""), "null: the model's folder"),
    "data.seed": _convert(unless_null("data.seed"), "null: tinyzero's seeded order (data.seed=1)"),
    "trainer.resume_from_path": _convert(null_as("trainer.resume_from_path", ""), "null: none"),
    # ---- data
    "data.filter_overlong_prompts_workers": _ignore("prompts are filtered in the loading process"),
    "data.tokenizer": _refuse("the tokenizer comes from the model folder", "actor_rollout_ref.model.tokenizer_path",
                              None),
    "data.use_shm": _ignore(PERF),
    "data.train_max_samples": _refuse("tinyzero trains on the whole file", "trainer.total_training_steps", -1, None),
    "data.val_max_samples": _refuse("tinyzero validates on the whole file", "a smaller data.val_files parquet",
                                    -1, None),
    "data.reward_fn_key": _refuse("the reward function is picked by the data_source column",
                                  "data.reward_fn_key=data_source", "data_source"),
    "data.tool_config_path": _ignore(FOLLOWS + " (actor_rollout_ref.rollout.multi_turn.tools)"),
    "data.return_raw_input_ids": _ignore("the reward model re-encodes responses when reward_model.input_tokenizer "
                                         "is set"),
    "data.return_full_prompt": _ignore("the batch keeps the prompt ids; data.return_raw_chat keeps the messages"),
    "data.dataloader_num_workers": _ignore("prompts are tokenized once at load; the loader runs in-process"),
    "data.image_patch_size": _ignore("text-only models"),
    "data.image_key": _ignore("text-only models"),
    "data.video_key": _ignore("text-only models"),
    "data.return_multi_modal_inputs": _ignore("text-only models"),
    "data.validation_shuffle": _refuse("validation runs in file order", "data.validation_shuffle=false", False),
    "data.trust_remote_code": _refuse("the tokenizer is loaded with the model's setting",
                                      "actor_rollout_ref.model.trust_remote_code=true", False),
    "data.custom_cls.*": _refuse("tinyzero's RL dataset reads the RL parquet rows (docs/your-own-task.md)",
                                 "a parquet in the RL row format", None),
    "data.sampler.*": _refuse("tinyzero samples prompts with its seeded, resumable sampler",
                              "data.shuffle / data.seed", None),
    "data.datagen.*": _refuse("tinyzero reads prompts from data.train_files", "data.train_files", None),
    "data.apply_chat_template_kwargs": _refuse("the chat template is applied without extra arguments",
                                               "data.apply_chat_template", {}, None),
    # ---- model
    f"{MODEL}.hf_config_path": _refuse("the config comes from the model folder", f"{MODEL}.override_config", None),
    f"{MODEL}.use_shm": _ignore(PERF),
    f"{MODEL}.custom_chat_template": _refuse("the chat template comes from the tokenizer folder",
                                             f"{MODEL}.tokenizer_path (a folder with the template)", None),
    f"{MODEL}.external_lib": _refuse("models load from a local HF folder", f"{MODEL}.trust_remote_code=true", None),
    f"{MODEL}.enable_activation_offload": _ignore(PERF + " (see model.enable_gradient_checkpointing)"),
    f"{MODEL}.exclude_modules": _refuse("LoRA adapts every matched module", f"{MODEL}.target_modules", None),
    f"{MODEL}.lora_adapter_path": _refuse("LoRA starts from fresh adapters", f"{MODEL}.lora_rank", None),
    f"{MODEL}.use_liger": _ignore(PERF),
    f"{MODEL}.use_fused_kernels": _ignore("tinyzero computes log-probs with its own fused kernel where it applies"),
    f"{MODEL}.fused_kernel_options.*": _ignore("tinyzero computes log-probs with its own fused kernel"),
    f"{MODEL}.tiled_mlp.*": _ignore(PERF),
    f"{MODEL}.mtp.*": _ignore("used with model.mtp.enable only"),
    f"{MODEL}.mtp.enable": _refuse("no multi-token prediction", f"{MODEL}.mtp.enable=false", False),
    # ---- actor
    f"{ACTOR}.strategy": _convert(strategy(ACTOR), "FSDP2"),
    f"{ACTOR}.rollout_n": _ignore(FOLLOWS + " (actor_rollout_ref.rollout.n)"),
    f"{ACTOR}.use_remove_padding": _ignore(FOLLOWS + " (actor_rollout_ref.model.use_remove_padding)"),
    f"{ACTOR}.use_fused_kernels": _ignore(FOLLOWS + " (actor_rollout_ref.model.use_fused_kernels)"),
    f"{ACTOR}.data_loader_seed": _rename(f"{ACTOR}.seed"),
    f"{ACTOR}.tau_pos": _refuse("no soft-gated policy loss", f"{ACTOR}.policy_loss.loss_mode", 1.0),
    f"{ACTOR}.tau_neg": _refuse("no soft-gated policy loss", f"{ACTOR}.policy_loss.loss_mode", 1.05),
    f"{ACTOR}.freeze_vision_tower": _refuse("text-only models", f"{ACTOR}.freeze_vision_tower=false", False),
    f"{ACTOR}.loss_scale_factor": _refuse("the loss is scaled by loss_agg_mode alone",
                                          f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm", None),
    f"{ACTOR}.calculate_entropy": _ignore("the update logs actor/entropy always"),
    f"{ACTOR}.use_prefix_grouper": _convert(lambda v: [(f"{MODEL}.use_shared_prefix", True)] if v else [],
                                            "each group's prompt computed once: model.use_shared_prefix"),
    f"{ACTOR}.calculate_sum_pi_squared": _refuse("no sum-pi-squared statistic", "an advantage estimator of "
                                                 "algorithm.adv_estimator", False),
    f"{ACTOR}.sum_pi_squared_checkpointing": _ignore(PERF),
    f"{ACTOR}.router_replay.*": _refuse("no MoE router replay", f"{ACTOR}.router_replay.mode=disabled",
                                        "disabled", None),
    f"{REF}.router_replay.*": _refuse("no MoE router replay", f"{REF}.router_replay.mode=disabled", "disabled", None),
    f"{ACTOR}.checkpoint.save_contents": _rename(f"{ACTOR}.checkpoint.contents"),
    f"{ACTOR}.checkpoint.load_contents": _convert(load_contents(ACTOR), "resume loads what was saved"),
    f"{ACTOR}.checkpoint.async_save": _ignore("checkpoints are written atomically in the step"),
    # ---- reference
    f"{REF}.rollout_n": _ignore(FOLLOWS + " (actor_rollout_ref.rollout.n)"),
    f"{REF}.strategy": _convert(strategy(REF), "FSDP2"),
    f"{REF}.use_torch_compile": _ignore(PERF),
    # ---- rollout
    f"{ROLLOUT}.name": _convert(rollout_name, "vllm, native (veRL's hf), remote"),
    f"{ROLLOUT}.mode": _ignore("tinyzero's engines run in the trainer's processes; sync and async give the same "
                               "samples"),
    f"{ROLLOUT}.ignore_eos": _refuse("responses end at the EOS token", f"{ROLLOUT}.ignore_eos=false", False),
    f"{ROLLOUT}.cudagraph_capture_sizes": _ignore(PERF),
    f"{ROLLOUT}.data_parallel_size": _refuse("the rollout is data-parallel over every tensor-parallel group",
                                             f"{ROLLOUT}.tensor_model_parallel_size", 1),
    f"{ROLLOUT}.expert_parallel_size": _refuse("no expert parallelism", f"{ROLLOUT}.tensor_model_parallel_size", 1),
    f"{ROLLOUT}.pipeline_model_parallel_size": _refuse("no pipeline parallelism",
                                                       f"{ROLLOUT}.tensor_model_parallel_size", 1),
    f"{ROLLOUT}.max_model_len": _ignore("the engine holds data.max_prompt_length + data.max_response_length"),
    f"{ROLLOUT}.enable_chunked_prefill": _ignore(PERF + " (vLLM: chunked by max_num_batched_tokens)"),
    f"{ROLLOUT}.enable_prefix_caching": _ignore(PERF + " (native: native_prefix_sharing)"),
    f"{ROLLOUT}.logprobs_mode": _refuse("the engines report log_softmax(logits / temperature) after top-k/top-p",
                                        f"{ROLLOUT}.logprobs_mode=processed_logprobs", "processed_logprobs"),
    f"{ROLLOUT}.scheduling_policy": _ignore(PERF),
    f"{ROLLOUT}.load_format": _ignore("the engine gets the trainer's weights at every sync, whatever it loads first"),
    f"{ROLLOUT}.layered_summon": _ignore("weights are always streamed to the engine one bucket of layers at a time"),
    f"{ROLLOUT}.disable_log_stats": _ignore(PERF),
    f"{ROLLOUT}.over_sample_rate": _refuse("every sampled response is trained on", f"{ROLLOUT}.over_sample_rate=0", 0),
    f"{ROLLOUT}.multi_stage_wake_up": _ignore(PERF + " (rollout.sleep_level)"),
    f"{ROLLOUT}.engine_kwargs.*": _ignore("tinyzero sets the engine's arguments itself from the rollout section"),
    f"{ROLLOUT}.calculate_log_probs": _ignore("the engines always return the sampler's log-probs"),
    f"{ROLLOUT}.agent.num_workers": _ignore("the agent loop runs in the trainer's processes"),
    f"{ROLLOUT}.agent.default_agent_loop": _refuse("multi-turn rollouts are switched on by multi_turn.enable",
                                                   f"{ROLLOUT}.multi_turn.enable=true", "single_turn_agent",
                                                   "tool_agent"),
    f"{ROLLOUT}.agent.agent_loop_config_path": _refuse("one agent loop (tinyzero.agent)", f"{ROLLOUT}.multi_turn.*",
                                                       None),
    f"{ROLLOUT}.agent.custom_async_server.*": _refuse("in-process engines", f"{ROLLOUT}.name=remote", None),
    f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes": _rename(f"{ROLLOUT}.weight_sync_bucket_mb"),
    f"{ROLLOUT}.checkpoint_engine.*": _ignore("weights go to the engine through tinyzero's own streamer"),
    f"{ROLLOUT}.trace.*": _ignore(PROFILE),
    f"{ROLLOUT}.skip_rollout": _refuse("every step generates", f"{ROLLOUT}.skip_rollout=false", False),
    f"{ROLLOUT}.skip_dump_dir": _ignore("used with skip_rollout only"),
    f"{ROLLOUT}.skip_tokenizer_init": _ignore(PERF),
    f"{ROLLOUT}.enable_rollout_routing_replay": _refuse("no MoE router replay",
                                                        f"{ROLLOUT}.enable_rollout_routing_replay=false", False),
    f"{ROLLOUT}.prometheus.*": _ignore("metrics go to trainer.logger"),
    f"{ROLLOUT}.quantization": _refuse("the engine runs the trainer's weights unquantized", f"{ROLLOUT}.dtype",
                                       None),
    f"{ROLLOUT}.quantization_config_file": _refuse("the engine runs the trainer's weights unquantized",
                                                   f"{ROLLOUT}.dtype", None),
    f"{ROLLOUT}.mtp": _refuse("no multi-token prediction", f"{ROLLOUT}.mtp=null", None),
    f"{ROLLOUT}.profiler.*": _ignore(PROFILE),
    f"{ROLLOUT}.multi_turn.max_assistant_turns": _convert(unless_null(f"{ROLLOUT}.multi_turn.max_turns"), "multi_turn.max_turns (null: tinyzero's "
                                                          "default)"),
    f"{ROLLOUT}.multi_turn.max_user_turns": _refuse("user turns come from a multi_turn.environment",
                                                    f"{ROLLOUT}.multi_turn.environment", None),
    f"{ROLLOUT}.multi_turn.tool_config_path": _refuse("tools are named, not configured by a veRL tool YAML",
                                                      f"{ROLLOUT}.multi_turn.tools=[calculator,path/to/tool.py:Name]",
                                                      None),
    f"{ROLLOUT}.multi_turn.max_parallel_calls": _rename(f"{ROLLOUT}.multi_turn.max_tool_calls_per_turn"),
    f"{ROLLOUT}.multi_turn.max_tool_response_length": _rename(f"{ROLLOUT}.multi_turn.max_observation_chars"),
    f"{ROLLOUT}.multi_turn.tool_response_truncate_side": _ignore("tool results are cut at the end, with a marker"),
    f"{ROLLOUT}.multi_turn.interaction_config_path": _refuse("user turns come from a multi_turn.environment",
                                                             f"{ROLLOUT}.multi_turn.environment", None),
    f"{ROLLOUT}.multi_turn.use_inference_chat_template": _ignore("turns are rendered with the tokenizer's chat "
                                                                 "template"),
    f"{ROLLOUT}.multi_turn.tokenization_sanity_check_mode": _ignore("observation tokens are appended as encoded"),
    f"{ROLLOUT}.multi_turn.format": _refuse("tool calls are parsed in the hermes format (<tool_call>...)",
                                            f"{ROLLOUT}.multi_turn.format=hermes", "hermes"),
    f"{ROLLOUT}.multi_turn.num_repeat_rollouts": _refuse("each prompt is sampled rollout.n times",
                                                         f"{ROLLOUT}.n", None),
    # ---- critic
    "critic.strategy": _convert(strategy("critic"), "FSDP2"),
    "critic.enable": _ignore("the critic is trained when algorithm.adv_estimator needs one (gae)"),
    "critic.data_loader_seed": _rename("critic.seed"),
    "critic.model.fsdp_config.*": _rename("critic.fsdp_config.*", "tinyzero's critic has its fsdp_config beside "
                                          "its model"),
    "critic.model.external_lib": _refuse("models load from a local HF folder", "critic.model.trust_remote_code=true",
                                         None),
    "critic.model.use_shm": _ignore(PERF),
    "critic.model.enable_activation_offload": _ignore(PERF),
    "critic.model.tiled_mlp.*": _ignore(PERF),
    "critic.checkpoint.save_contents": _rename("critic.checkpoint.contents"),
    "critic.checkpoint.load_contents": _convert(load_contents("critic"), "resume loads what was saved"),
    "critic.checkpoint.async_save": _ignore("checkpoints are written atomically in the step"),
    "critic.profiler.*": _ignore(PROFILE),
    # ---- reward model and reward manager
    "reward_model.enable_resource_pool": _refuse("the reward model shares the critic's ranks",
                                                 "pipeline.placement=split", False),
    "reward_model.n_gpus_per_node": _ignore("the reward model runs on the critic's ranks (pipeline.placement)"),
    "reward_model.nnodes": _ignore("the reward model runs on the critic's ranks (pipeline.placement)"),
    "reward_model.strategy": _convert(strategy("reward_model"), "FSDP2"),
    "reward_model.model.input_tokenizer": _rename("reward_model.input_tokenizer"),
    "reward_model.model.fsdp_config.*": _rename("reward_model.fsdp_config.*"),
    "reward_model.model.external_lib": _refuse("models load from a local HF folder",
                                               "reward_model.model.trust_remote_code=true", None),
    "reward_model.model.use_shm": _ignore(PERF),
    "reward_model.model.use_fused_kernels": _ignore(PERF),
    "reward_model.reward_manager": _convert(reward_manager, "naive, batch, dapo and prime"),
    "reward_model.reward_loop_source": _ignore("one reward manager"),
    "reward_model.reward_loop_module_path": _refuse("one reward manager", "custom_reward_function.path", None),
    "reward_model.reward_loop_class_name": _refuse("one reward manager", "custom_reward_function.name", None),
    "reward_model.launch_reward_fn_async": _ignore("rewards are scored in worker processes beside the trainer"),
    "reward_model.sandbox_fusion.url": _rename("reward.sandbox.url"),
    "reward_model.sandbox_fusion.max_concurrent": _rename("reward.sandbox.max_concurrent"),
    "reward_model.sandbox_fusion.memory_limit_mb": _rename("reward.sandbox.memory_limit_mb"),
    "reward_model.sandbox_fusion.*": _ignore("the SandboxFusion client takes url, max_concurrent and memory_limit_mb"),
    "reward_model.profiler.*": _ignore(PROFILE),
    "reward_model.ulysses_sequence_parallel_size": _refuse("the reward model runs without sequence parallelism",
                                                           "reward_model.ulysses_sequence_parallel_size=1", 1),
    "reward_model.use_reward_loop": _ignore("picks between veRL's reward implementations; tinyzero has one"),
    "reward_model.num_workers": _rename("reward.num_workers"),
    "reward_model.rollout.*": _ignore("the reward model runs in tinyzero's FSDP workers, not a served engine"),
    "reward_manager.source": _refuse("one reward manager", "reward_manager.source=register", "register"),
    "reward_manager.name": _convert(reward_manager, "naive, batch, dapo and prime"),
    "reward_manager.module.*": _refuse("one reward manager", "custom_reward_function.path", None,
                                       "custom_reward_manager"),
    # ---- algorithm
    "algorithm.use_pf_ppo": _refuse("no priority-filtered PPO", "algorithm.filter_groups.enable", False),
    "algorithm.pf_ppo.*": _ignore("used with algorithm.use_pf_ppo only"),
    # tinyzero's own earlier names: configs saved before the tuning section keep loading
    "trainer.host_trim_threshold_mb": _rename("tuning.host_trim_threshold_mb"),
    "trainer.host_mmap_threshold_kb": _rename("tuning.host_mmap_threshold_kb"),
    "trainer.host_keep_freed_memory": _rename("tuning.host_keep_freed_memory"),
}

# Keys every training role shares: the optimizer and FSDP engine settings of veRL's new engine config.
for _role in (ACTOR, "critic"):
    KEYS.update({
        f"{_role}.optim.optimizer": _refuse("tinyzero's optimizer is AdamW", f"{_role}.optim.optimizer=AdamW",
                                            "AdamW", "adamw"),
        f"{_role}.optim.optimizer_impl": _refuse("tinyzero's optimizer is torch.optim.AdamW",
                                                 f"{_role}.optim.implementation", "torch.optim"),
        f"{_role}.optim.clip_grad": _rename(f"{_role}.grad_clip"),
        f"{_role}.optim.lr_scheduler_type": _convert(unless_null(f"{_role}.optim.warmup_style"),
                                                     "optim.warmup_style"),
        f"{_role}.optim.warmup_style": _convert(unless_null(f"{_role}.optim.warmup_style"),
                                                "null: optim.lr_scheduler_type decides"),
        f"{_role}.optim.override_optimizer_config": _refuse("AdamW takes the optim section's settings",
                                                            f"{_role}.optim.betas / weight_decay", None, {}),
    })
for _role, _model in ((ACTOR, MODEL), (REF, None), ("critic", "critic.model"), ("reward_model", None)):
    _fsdp = f"{_role}.fsdp_config"
    KEYS.update({
        f"{_fsdp}.forward_prefetch": _ignore(PERF),
        f"{_fsdp}.use_orig_params": _ignore("an FSDP1 setting; tinyzero uses FSDP2"),
        f"{_fsdp}.seed": _ignore("tinyzero seeds from trainer.seed"),
        f"{_fsdp}.full_determinism": _ignore("CPU runs are deterministic; GPU kernels follow torch's settings"),
        f"{_fsdp}.entropy_from_logits_with_chunking": _ignore(PERF),
        f"{_fsdp}.entropy_checkpointing": _ignore(PERF),
        f"{_fsdp}.use_torch_compile": _ignore(PERF),
        f"{_fsdp}.forward_only": _ignore(FOLLOWS + " (from the role)"),
        f"{_fsdp}.strategy": _convert(strategy(_role), "FSDP2"),
        f"{_fsdp}.dtype": _convert(dtype_to(f"{_fsdp}.mixed_precision.param_dtype"),
                                   "the compute dtype: fsdp_config.mixed_precision.param_dtype"),
        f"{_fsdp}.ulysses_sequence_parallel_size": (
            _rename(f"{_role}.ulysses_sequence_parallel_size") if _role != "reward_model" else
            _refuse("the reward model runs without sequence parallelism", f"{_fsdp}.ulysses_sequence_parallel_size=1",
                    1)),
        f"{_fsdp}.model_dtype": (_rename(f"{_model}.dtype") if _model else
                                 _refuse("the frozen model is held like the actor's", f"{MODEL}.dtype", "fp32",
                                         "float32")),
    })
for _role in (ACTOR, REF):
    KEYS.update({
        f"{_role}.use_torch_compile": _ignore(PERF),
        f"{_role}.entropy_from_logits_with_chunking": _ignore(PERF),
        f"{_role}.entropy_checkpointing": _ignore(PERF),
        f"{_role}.profiler.*": _ignore(PROFILE),
    })


# --------------------------------------------------------------------------- lookup


@functools.cache
def _tinyzero_keys() -> tuple[frozenset[str], frozenset[str]]:
    """(every field of tinyzero's root config, every section): ("trainer.seed", ...), ("trainer", ...)."""
    from tinyzero.config.parse import flag_names

    leaves = flag_names()
    sections = {leaf.rsplit(".", i)[0] for leaf in leaves for i in range(1, leaf.count(".") + 1)}
    return frozenset(leaves), frozenset(sections)


def _lookup(path: str) -> tuple[str, Rule] | None:
    """The rule for `path`: its own entry, else the longest prefix entry (`a.b.*` covers `a.b` and below)."""
    if path in KEYS:
        return path, KEYS[path]
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        pattern = ".".join(parts[:i]) + ".*"
        if pattern in KEYS:
            return pattern, KEYS[pattern]
    return None


def _has_rules_under(path: str) -> bool:
    return any(key.startswith(path + ".") and key != path + ".*" for key in KEYS)


def _matches(value: Any, accepted: tuple) -> bool:
    """Whether `value` is one of `accepted` (1 == 1.0, but True is not 1)."""
    for a in accepted:
        if isinstance(a, bool) or isinstance(value, bool) or a is None or value is None:
            if type(a) is type(value) and a == value:
                return True
        elif isinstance(a, (int, float)) and isinstance(value, (int, float)):
            if float(a) == float(value):
                return True
        elif a == value:
            return True
    return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_warned: set[str] = set()


def _warn_ignored(path: str, value: Any, why: str) -> None:
    """One warning per ignored key and process, on rank 0."""
    from tinyzero.distributed import get_rank

    if path not in _warned and get_rank() == 0:
        _warned.add(path)
        warnings.warn(f"{path}={_short(value)} ignored: {why}", UserWarning, stacklevel=3)


def _expand(path: str, values: dict) -> list[tuple[str, Any]]:
    """A section given as a mapping (a YAML file): each of its keys resolved on its own."""
    return [pair for key, value in values.items() for pair in resolve_key(f"{path}.{key}", value)]


def resolve_key(path: str, value: Any) -> list[tuple[str, Any]]:
    """The (tinyzero key, value) pairs that `path=value` sets: [(path, value)] for a tinyzero key,
    [] for an ignored one; raises ConfigError for a refused one."""
    if path.rsplit(".", 1)[-1] == "_target_":  # veRL's dataclass markers carry no setting
        return []
    fields, sections = _tinyzero_keys()
    found = _lookup(path)
    if found is None or (path in fields | sections and path not in KEYS):
        if isinstance(value, dict) and value and path in sections:
            return _expand(path, value)
        return [(path, value)]
    pattern, rule = found
    if isinstance(value, dict) and value and pattern == path + ".*" and (
            rule.action != "ignore" or _has_rules_under(path)):
        return _expand(path, value)
    if rule.action == "rename":
        if pattern.endswith(".*"):
            return resolve_key(rule.to[:-2] + path[len(pattern) - 2:], value)
        return resolve_key(rule.to, value) if rule.to != path else [(path, value)]
    if rule.action == "convert":
        return rule.convert(value)
    if rule.action == "ignore":
        _warn_ignored(path, value, rule.why)
        return []
    if _matches(value, rule.accept):
        return []
    raise config_error(f"{path}={_short(value)} is not supported: {rule.why}; nearest supported setting: {rule.nearest}")
