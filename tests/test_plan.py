"""The run plan (tinyzero.plan): pools, layouts, batch shares and the engine, derived once from the user's
config and the world size, without writing to the user's config."""

from __future__ import annotations

import ast
import pathlib

import pytest

from tinyzero.config import Config, ConfigError
from tinyzero.config.parse import merge_dict, to_dict
from tinyzero.plan import plan_run

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "tinyzero"


def _cfg(values: dict) -> Config:
    return merge_dict(Config(), values)


def test_the_users_config_is_never_written():
    cfg = _cfg({"algorithm": {"adv_estimator": "gae"}, "data": {"train_batch_size": 8, "max_response_length": 24},
                "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size": 4},
                                      "rollout": {"name": "auto"}}})
    before = to_dict(cfg)
    plan = plan_run(cfg, 2, notice=None)
    assert to_dict(cfg) == before
    resolved = plan.config
    assert resolved is not cfg
    assert resolved.actor_rollout_ref.rollout.response_length == 24  # follows data.max_response_length
    assert resolved.critic.ppo_mini_batch_size == 4                   # the actor's, veRL's default
    assert resolved.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2  # veRL's global form / dp
    assert resolved.actor_rollout_ref.rollout.name == plan.engine != "auto"


@pytest.mark.parametrize("placement,world,actor,critic", [("colocate", 4, (0, 1, 2, 3), (0, 1, 2, 3)),
                                                           ("split", 4, (0, 1), (2, 3))])
def test_pools_and_layouts(placement, world, actor, critic):
    cfg = _cfg({"algorithm": {"adv_estimator": "gae"}, "pipeline": {"placement": placement},
                "data": {"train_batch_size": 8}, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}}})
    plan = plan_run(cfg, world, notice=None)
    assert plan.pools["actor"] == actor and plan.pools["critic"] == critic and plan.pools["rollout"] == actor
    assert plan.dims["actor"].world == len(actor) and plan.dims["critic"].world == len(critic)
    # rows per data-parallel rank per mini-batch: prompts x n / dp
    assert plan.rows_per_mini_batch["actor"] == 4 * 1 // len(actor)
    assert "ref" not in plan.dims  # no KL: no reference
    assert plan.summary()["pools"]["critic"] == list(critic)


@pytest.mark.parametrize("teacher_pool,ranks", [("policy", (0, 1)), ("split", (2, 3))])
def test_teacher_on_the_policy_pool_or_the_split_one(teacher_pool, ranks):
    """distill.teacher_pool: beside the actor (laid out like the reference model) or on the second pool of a
    split placement; split without a split placement is refused naming both settings."""
    from tinyzero.config import ConfigError

    settings = {"pipeline": {"placement": "split"}, "data": {"train_batch_size": 8},
                "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}},
                "distill": {"teacher_path": "runs/teacher", "teacher_pool": teacher_pool}}
    plan = plan_run(_cfg(settings), 4, notice=None)
    assert plan.pools["actor"] == (0, 1) and plan.pools["teacher"] == ranks
    assert plan.dims["teacher"].world == 2
    with pytest.raises(ConfigError, match="distill.teacher_pool=split.*pipeline.placement=split"):
        _cfg({**settings, "pipeline": {"placement": "colocate"}, "distill": {"teacher_path": "t",
                                                                               "teacher_pool": "split"}})


def test_asynchronous_pools():
    cfg = _cfg({"pipeline": {"rollout_pool_size": 1}, "data": {"train_batch_size": 4},
                "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}, "rollout": {"n": 2}},
                "algorithm": {"adv_estimator": "grpo"}})
    plan = plan_run(cfg, 3, notice=None)
    assert plan.asynchronous and plan.pools["actor"] == (0, 1) and plan.pools["rollout"] == (2,)
    assert plan.dims["actor"].world == 2 and plan.dims["rollout"].world == 1


def test_auto_engine_under_trainer_device_cpu_is_native(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host
    said = []
    cfg = _cfg({"trainer": {"device": "cpu"}, "actor_rollout_ref": {"rollout": {"name": "auto"}}})
    assert plan_run(cfg, 1, notice=said.append).engine == "native"
    assert said[0] == "rollout.name=auto -> native (trainer.device=cpu)"


def test_mini_batch_rules_name_the_setting():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.ppo_mini_batch_size=16 exceeds"):
        plan_run(_cfg({"data": {"train_batch_size": 8}, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 16}}}),
                 1, notice=None)
    with pytest.raises(ConfigError, match=r"data\.train_batch_size=10 must be a multiple of"):
        plan_run(_cfg({"data": {"train_batch_size": 10}, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}}}),
                 1, notice=None)


def test_parallel_dims_are_built_in_one_place():
    """Only the role-layout functions (workers/config.py) construct a ParallelDims; the plan calls them once per
    pool and the workers take the plan's (a worker built outside a run derives its own through them).
    models/fsdp.make_fsdp_mesh lays out a bare model over the whole world, outside any role."""
    builders = {"for_role", "parallel_dims", "rollout_dims"}
    callers = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if name in builders:
                    callers.add(path.relative_to(SRC).as_posix())
    assert callers == {"workers/config.py", "models/fsdp.py"}, callers


GRPO = {"algorithm": {"adv_estimator": "grpo"}, "data": {"train_batch_size": 4},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}, "rollout": {"n": 4, "name": "native"}}}
FAST = {"actor_rollout_ref.model.use_shared_prefix": True, "actor_rollout_ref.model.use_remove_padding": True,
        "actor_rollout_ref.model.use_fused_layers": True, "actor_rollout_ref.rollout.sleep_level": 2}


def _fast(plan) -> dict:
    """The actor's speed settings as the plan resolved them."""
    arr = plan.config.actor_rollout_ref
    return {"actor_rollout_ref.model.use_shared_prefix": arr.model.use_shared_prefix,
            "actor_rollout_ref.model.use_remove_padding": arr.model.use_remove_padding,
            "actor_rollout_ref.model.use_fused_layers": arr.model.use_fused_layers,
            "actor_rollout_ref.rollout.sleep_level": arr.rollout.sleep_level}


def _with(base: dict, **dotted) -> dict:
    import copy

    out = copy.deepcopy(base)
    for key, value in dotted.items():
        node = out
        *path, last = key.split("__")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def test_the_fast_path_is_the_default_on_cpu_and_said_once():
    """A GRPO run on the CPU that sets no speed setting gets the tuned ones (packing with shared prompts,
    fused layers, sleep level 2), said in one line; the user's config keeps None (what they wrote)."""
    cfg = _cfg(_with(GRPO, trainer__device="cpu"))
    said = []
    plan = plan_run(cfg, 2, notice=said.append)
    assert _fast(plan) == FAST
    assert plan.summary()["fast_path"]["actor_rollout_ref.rollout.sleep_level"] == 2
    assert plan.config.actor_rollout_ref.rollout.request_seeds is True  # samples independent of the batch
    assert cfg.actor_rollout_ref.model.use_shared_prefix is None and cfg.actor_rollout_ref.rollout.sleep_level is None
    assert said == ["speed settings for this machine: model.use_shared_prefix=true, model.use_remove_padding=true, "
                    "model.use_fused_layers=true, rollout.sleep_level=2, rollout.tensor_model_parallel_size=2 (set any of "
                    "them to override)"]
    assert plan.dims["rollout"].tp == 2 and plan.dims["rollout"].dp_size == 1  # both ranks decode the whole batch


@pytest.mark.parametrize("change,expect", [
    # what the user sets is kept as written, the rest still chosen
    ({"actor_rollout_ref__model__use_shared_prefix": False, "actor_rollout_ref__rollout__sleep_level": 1},
     {**FAST, "actor_rollout_ref.model.use_shared_prefix": False, "actor_rollout_ref.rollout.sleep_level": 1}),
    # one sample per prompt: no group to share a prompt with
    ({"actor_rollout_ref__rollout__n": 1, "algorithm__adv_estimator": "reinforce_plus_plus"}, {**FAST, "actor_rollout_ref.model.use_shared_prefix": False}),
    # LoRA: the sync carries the adapters only (level 2 would lose the base), fused layers not proven with it
    ({"actor_rollout_ref__model__lora_rank": 4},
     {**FAST, "actor_rollout_ref.model.use_fused_layers": False, "actor_rollout_ref.rollout.sleep_level": 1}),
    # fused layers work on plain tensors, not under tensor parallelism
    ({"actor_rollout_ref__actor__tensor_model_parallel_size": 2, "actor_rollout_ref__ref__tensor_model_parallel_size": 2},
     {**FAST, "actor_rollout_ref.model.use_fused_layers": False}),
    # a rollout pool of its own holds no actor to re-send discarded weights
    ({"pipeline__rollout_pool_size": 1}, {**FAST, "actor_rollout_ref.rollout.sleep_level": 1}),
])
def test_fast_path_rules(change, expect):
    plan = plan_run(_cfg(_with(GRPO, trainer__device="cpu", **change)), 2, notice=None)
    assert _fast(plan) == expect


def test_gpu_hosts_and_supervised_modes_keep_the_plain_path(monkeypatch):
    """Nothing of the fast path has been measured on a GPU: there every choice is off and the sleep level 1;
    SFT, RM and DPO keep unpacked passes."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host
    plan = plan_run(_cfg(_with(GRPO, trainer__device="auto")), 2, notice=None)
    assert _fast(plan) == {key: (1 if key.endswith("sleep_level") else False) for key in FAST}
    assert plan.config.actor_rollout_ref.rollout.request_seeds is False  # vLLM's one-draw batch sampler
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sft = plan_run(_cfg(_with(GRPO, trainer__mode="sft", trainer__device="cpu")), 2, notice=None)
    assert not sft.config.actor_rollout_ref.model.use_remove_padding
    assert not sft.config.actor_rollout_ref.model.use_fused_layers


def test_rollout_tensor_parallel_default_follows_the_model_and_the_pool(monkeypatch):
    """The native engine on CPU decodes over the whole one-host policy pool; a model whose MLP does not split
    evenly (or that the fused decoder does not run) takes it back to 1; a pool over several hosts, the agent
    loop and a user's value keep their own."""
    from types import SimpleNamespace

    from tinyzero.plan import with_model

    cfg = _cfg(_with(GRPO, trainer__device="cpu"))
    plan = plan_run(cfg, 2, notice=None)
    qwen = SimpleNamespace(model_type="qwen2", intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           hidden_size=64, vocab_size=128, num_hidden_layers=2,
                           max_position_embeddings=4096)
    assert with_model(plan, qwen).dims["rollout"].tp == 2
    odd = with_model(plan, SimpleNamespace(**{**vars(qwen), "intermediate_size": 255}))
    assert odd.dims["rollout"].tp == 1 and odd.config.actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    assert odd.fast_path["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 1
    assert with_model(plan, SimpleNamespace(**{**vars(qwen), "model_type": "gpt2"})).dims["rollout"].tp == 1
    agent = plan_run(_cfg(_with(GRPO, trainer__device="cpu", actor_rollout_ref__rollout__multi_turn={"enable": True, "tools": ["calculator"]})),
                     2, notice=None)
    assert agent.dims["rollout"].tp == 1
    user = plan_run(_cfg(_with(GRPO, trainer__device="cpu", actor_rollout_ref__rollout__tensor_model_parallel_size=1)),
                    2, notice=None)
    assert user.dims["rollout"].tp == 1 and "actor_rollout_ref.rollout.tensor_model_parallel_size" not in user.fast_path
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two hosts of one rank each
    assert plan_run(cfg, 2, notice=None).dims["rollout"].tp == 1


@pytest.mark.parametrize("change,message", [
    ({"data": {"train_batch_size": 12}, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8, "shuffle": False}}},
     r"data.train_batch_size=12 must be a multiple of .*ppo_mini_batch_size=8"),
    ({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2, "shuffle": False}}},
     r"ppo_mini_batch_size=2 pairs must split over the 4 ranks"),
    ({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 1,
                                      "shuffle": False}}}, r"ppo_micro_batch_size_per_gpu=1 must be even for DPO"),
    ({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "shuffle": True}}},
     r"DPO keeps chosen/rejected rows adjacent"),
    ({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "shuffle": False},
                            "ref": {"ulysses_sequence_parallel_size": 2}}}, r"trainer.mode=dpo trains data-parallel"),
])
def test_dpo_pairs_are_checked_by_the_plan(change, message):
    """DPO's pair rules are part of the plan: refused before any model loads, naming the setting."""
    base = {"trainer": {"mode": "dpo"}, "data": {"train_batch_size": 8},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "shuffle": False}}}
    assert plan_run(_cfg(base), 4, notice=None).dims["actor"].world == 4
    values = {**base, **change}
    values["actor_rollout_ref"] = {**base["actor_rollout_ref"], **change.get("actor_rollout_ref", {})}
    with pytest.raises(ConfigError, match=message):
        plan_run(_cfg(values), 4, notice=None)
