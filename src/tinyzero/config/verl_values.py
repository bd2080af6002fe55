"""The value conversions of veRL keys whose value tinyzero takes in another form (tinyzero.config.verl's
table refers to them): a setting it derives, a default it treats as "nothing to set", or a value it
refuses with one line naming the nearest supported setting."""

from __future__ import annotations

from typing import Any


def config_error(msg: str):
    from tinyzero.config.root import ConfigError

    return ConfigError(msg)


def hdfs(value):
    if value in (None, "", "null"):
        return []
    raise config_error(f"trainer.default_hdfs_dir={value!r}: tinyzero writes checkpoints to trainer.default_local_dir only "
                 "(no HDFS copy); set trainer.default_hdfs_dir=null and copy the run folder yourself")


def unless_null(key: str):
    def fn(value):
        return [] if value is None else [(key, value)]
    return fn


def null_as(key: str, empty: Any):
    def fn(value):
        return [(key, empty if value is None else value)]
    return fn


def rollout_name(value):
    if value == "hf":
        return [("actor_rollout_ref.rollout.name", "native")]  # veRL's HF rollout: plain HF generate
    if value in ("sglang", "trtllm"):
        raise config_error(f"actor_rollout_ref.rollout.name={value}: tinyzero has no {value} engine; nearest supported "
                     "setting: actor_rollout_ref.rollout.name=vllm (or native)")
    return [("actor_rollout_ref.rollout.name", value)]


def strategy(section: str):
    def fn(value):
        if value in (None, "fsdp", "fsdp2"):
            return []
        raise config_error(f"{section}.strategy={value}: tinyzero trains with FSDP2 only; nearest supported setting: "
                     f"{section}.strategy=fsdp2 (tensor parallelism: {section}.tensor_model_parallel_size)")
    return fn


def dtype_to(target: str):
    """veRL's engine dtype keys: bfloat16 is veRL's default and tinyzero's "auto" on GPU (fp32 on CPU)."""
    def fn(value):
        return [] if value in (None, "bfloat16", "bf16") else [(target, value)]
    return fn


def load_contents(section: str):
    def fn(value):
        if value is None or {"model", "optimizer", "extra"} <= set(value):
            return []  # veRL's default: load what was saved, as tinyzero's resume does
        raise config_error(f"{section}.checkpoint.load_contents={list(value)}: tinyzero's resume loads everything a "
                     "checkpoint holds (model, optimizer, extra); nearest supported setting: "
                     f"{section}.checkpoint.load_contents=[model,optimizer,extra], or trainer.resume_mode=disable")
    return fn


def nccl_timeout(value):
    return [("reliability.collective_timeout_s", float(value))]


def reward_manager(value):
    from tinyzero.rewards.config import REWARD_MANAGERS

    if value is None:
        return []
    if value in REWARD_MANAGERS:  # tinyzero.rewards.manager implements each of veRL's registered managers
        return [("reward_model.reward_manager", value)]
    raise config_error(f"reward_model.reward_manager={value}: tinyzero has veRL's reward managers {list(REWARD_MANAGERS)}; "
                 "nearest supported setting: reward_model.reward_manager=naive with custom_reward_function.path")
