"""veRL's and TinyZero's keys on tinyzero's config (tinyzero.config.verl), and their scripts end to end.

The table: each class of key (tinyzero's own, renamed, converted, ignored, refused), the refusals'
one-line messages, every key of veRL's generated ppo_trainer.yaml with its default, and the
conversions that need the world size (veRL's global micro-batch sizes, n_gpus_per_node x nnodes).
End to end (slow): the argument lists of TinyZero's train_tiny_zero.sh and three veRL FSDP example
scripts (tests/assets/verl_scripts/), launched with `torchrun --nproc_per_node 2 train.py` and a
few CPU-scale overrides appended, train 2 steps on 2 CPU ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import yaml

from tinyzero.config import Config, ConfigError, verl
from tinyzero.config.parse import flag_names, merge_dict
from tinyzero.config.verl import KEYS, resolve_key
from tinyzero.plan import plan_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "assets", "verl_scripts")
FIELDS = set(flag_names())


def _tree(pairs):
    tree: dict = {}
    for key, value in pairs:
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _config(settings: dict[str, object]) -> Config:
    """Config() with `settings` applied through resolve_key, as the command line applies them."""
    pairs = [pair for key, value in settings.items() for pair in resolve_key(key, value)]
    return merge_dict(Config(), _tree(pairs))


# --------------------------------------------------------------------------- the table


def test_tinyzero_keys_pass_through_unchanged():
    for key in ("trainer.total_epochs", "actor_rollout_ref.actor.ppo_mini_batch_size", "data.train_files",
                "actor_rollout_ref.rollout.n", "algorithm.adv_estimator"):
        assert resolve_key(key, 3) == [(key, 3)]
    # an unknown key is left for the config reader to report
    assert resolve_key("trainer.no_such_key", 1) == [("trainer.no_such_key", 1)]


@pytest.mark.parametrize("key, value, expected", [
    ("trainer.max_actor_ckpt_to_keep", 2, [("trainer.max_ckpt_to_keep", 2)]),
    ("trainer.max_critic_ckpt_to_keep", 3, [("trainer.max_ckpt_to_keep", 3)]),
    ("actor_rollout_ref.actor.checkpoint.save_contents", ["model"],
     [("actor_rollout_ref.actor.checkpoint.contents", ["model"])]),
    ("critic.model.fsdp_config.param_offload", True, [("critic.fsdp_config.param_offload", True)]),
    ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", 5,
     [("actor_rollout_ref.rollout.multi_turn.max_turns", 5)]),
    ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", None, []),
    ("actor_rollout_ref.actor.optim.clip_grad", 0.5, [("actor_rollout_ref.actor.grad_clip", 0.5)]),
    ("actor_rollout_ref.actor.optim.lr_scheduler_type", "cosine",
     [("actor_rollout_ref.actor.optim.warmup_style", "cosine")]),
    ("actor_rollout_ref.actor.fsdp_config.model_dtype", "bf16", [("actor_rollout_ref.model.dtype", "bf16")]),
    ("actor_rollout_ref.actor.data_loader_seed", 42, [("actor_rollout_ref.actor.seed", 42)]),
    ("actor_rollout_ref.nccl_timeout", 600, [("reliability.collective_timeout_s", 600.0)]),
    ("actor_rollout_ref.rollout.name", "hf", [("actor_rollout_ref.rollout.name", "native")]),
    ("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes", 64,
     [("actor_rollout_ref.rollout.weight_sync_bucket_mb", 64)]),
    ("reward_model.model.input_tokenizer", "/m", [("reward_model.input_tokenizer", "/m")]),
    ("trainer.default_hdfs_dir", None, []),
    ("actor_rollout_ref.actor.use_prefix_grouper", True, [("actor_rollout_ref.model.use_shared_prefix", True)]),
])
def test_renamed_and_converted_keys(key, value, expected):
    assert resolve_key(key, value) == expected
    assert all(k in FIELDS for k, _ in expected)


@pytest.mark.parametrize("key, value, why", [
    ("ray_kwargs.ray_init.num_cpus", 8, "Ray"),
    ("ray_kwargs.timeline_json_file", "/tmp/t.json", "Ray"),
    ("actor_rollout_ref.rollout.load_format", "safetensors", "weights"),
    ("actor_rollout_ref.rollout.layered_summon", True, "streamed"),
    ("actor_rollout_ref.rollout.enable_chunked_prefill", False, "speed"),
    ("actor_rollout_ref.rollout.mode", "async", "same"),
    ("trainer.use_legacy_worker_impl", "auto", "one"),
    ("global_profiler.tool", "nsys", "profil"),
])
def test_ignored_keys_warn_once_with_the_reason(key, value, why):
    verl._warned.discard(key)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        assert resolve_key(key, value) == []
        assert resolve_key(key, value) == []
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{key}=") and "ignored: " in lines[0] and why in lines[0]
    assert "\n" not in lines[0]


@pytest.mark.parametrize("key, value, nearest", [
    ("trainer.default_hdfs_dir", "hdfs://x/ckpt", "trainer.default_local_dir"),
    ("actor_rollout_ref.rollout.name", "sglang", "rollout.name=vllm"),
    ("actor_rollout_ref.actor.strategy", "megatron", "strategy=fsdp2"),
    ("actor_rollout_ref.actor.tau_pos", 2.0, "policy_loss.loss_mode"),
    ("actor_rollout_ref.actor.loss_scale_factor", 512, "loss_agg_mode"),
    ("actor_rollout_ref.rollout.over_sample_rate", 0.1, "over_sample_rate=0"),
    ("actor_rollout_ref.actor.optim.optimizer", "SGD", "optimizer=AdamW"),
    ("data.train_max_samples", 100, "trainer.total_training_steps"),
    ("algorithm.use_pf_ppo", True, "filter_groups"),
    ("actor_rollout_ref.rollout.multi_turn.tool_config_path", "tools.yaml", "multi_turn.tools"),
    ("reward_model.reward_manager", "limited", "reward_manager=naive"),
    ("actor_rollout_ref.actor.checkpoint.load_contents", ["model"], "resume_mode=disable"),
])
def test_refused_keys_name_the_key_and_the_nearest_setting(key, value, nearest):
    with pytest.raises(ConfigError) as e:
        resolve_key(key, value)
    msg = str(e.value)
    assert msg.startswith(f"{key}=") and nearest in msg and "\n" not in msg


@pytest.mark.parametrize("key, value", [
    ("actor_rollout_ref.actor.tau_pos", 1.0), ("actor_rollout_ref.actor.tau_neg", 1.05),
    ("actor_rollout_ref.actor.strategy", "fsdp"), ("actor_rollout_ref.actor.strategy", "fsdp2"),
    ("actor_rollout_ref.rollout.over_sample_rate", 0), ("data.train_max_samples", -1),
    ("actor_rollout_ref.actor.optim.optimizer", "AdamW"), ("algorithm.use_pf_ppo", False),
    ("actor_rollout_ref.rollout.logprobs_mode", "processed_logprobs"),
    ("actor_rollout_ref.actor.checkpoint.load_contents", ["model", "optimizer", "extra"]),
    ("actor_rollout_ref.rollout.multi_turn.tool_config_path", None),
    ("data.custom_cls", {"path": None, "name": None}),
])
def test_refused_keys_accept_verls_default(key, value):
    assert resolve_key(key, value) == []


def test_refusal_accepts_no_look_alike_value():
    """A default of False is not 0, and 1.0 is 1: values compare as veRL's YAML types them."""
    assert resolve_key("actor_rollout_ref.rollout.data_parallel_size", 1.0) == []
    with pytest.raises(ConfigError):
        resolve_key("actor_rollout_ref.rollout.skip_rollout", 0)


def test_the_table_is_data_with_a_reason_per_entry():
    for key, rule in KEYS.items():
        assert rule.action in ("rename", "convert", "ignore", "refuse"), key
        if rule.action == "rename":
            assert rule.to, key
        elif rule.action == "refuse":
            assert rule.why and rule.nearest, key
        elif rule.action == "ignore":
            assert rule.why, key


def _verl_defaults() -> dict:
    with open(os.path.join(SCRIPTS, "ppo_trainer_defaults.yaml")) as f:
        return yaml.safe_load(f)


def _interpolated(value) -> bool:
    return isinstance(value, str) and ("${" in value or value == "???")


def test_every_key_of_verls_generated_config_is_classified():
    """Each leaf of veRL's ppo_trainer.yaml resolves onto tinyzero fields (or nothing, with a reason) at its
    default, except the reward function's keys (the rewards' own table)."""
    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, value in _verl_defaults().items():
            if key.startswith("custom_reward_function."):
                continue
            pairs = resolve_key(key, None if _interpolated(value) else value)
            missing += [(key, k) for k, _ in pairs if k not in FIELDS]
    assert not missing


def test_verls_defaults_build_a_valid_config():
    """The generated config's defaults, key by key, give a config tinyzero accepts (veRL's YAML loads)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, value in _verl_defaults().items():
            if _interpolated(value) or key.startswith("custom_reward_function."):
                continue
            merge_dict(Config(), _tree(resolve_key(key, value)))


def test_a_yaml_section_resolves_key_by_key():
    """A veRL YAML passes whole sections: each key is judged alone, veRL's _target_ markers carry nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pairs = resolve_key("critic.model.fsdp_config", {"_target_": "verl.x", "param_offload": True,
                                                         "forward_prefetch": False, "fsdp_size": 2})
        assert pairs == [("critic.fsdp_config.param_offload", True), ("critic.fsdp_config.fsdp_size", 2)]
        assert resolve_key("actor_rollout_ref.rollout.checkpoint_engine",
                           {"backend": "naive", "update_weights_bucket_megabytes": 128}) == [
            ("actor_rollout_ref.rollout.weight_sync_bucket_mb", 128)]


def _script_args(name: str, subs: dict[str, str]) -> list[str]:
    with open(os.path.join(SCRIPTS, name)) as f:
        lines = [line.strip() for line in f if line.strip()]
    out = []
    for line in lines:
        for k, v in subs.items():
            line = line.replace(k, v)
        out.append(line)
    return out


SCRIPT_NAMES = ["train_tiny_zero.txt", "grpo_qwen2-7b.txt", "ppo_deepseek7b_llm.txt", "grpo_lora_qwen2_5-3b.txt"]


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_key_of_the_scripts_resolves_onto_tinyzero(name):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    args = _script_args(name, {"$N_GPUS": "2", "$ROLLOUT_TP_SIZE": "1"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for arg in args:
            override = parser.parse_override(arg)
            for key, _ in resolve_key(override.key_or_group, override.value()):
                assert key in FIELDS, (arg, key)


# --------------------------------------------------------------------------- conversions with a world size


def test_global_micro_batch_sizes_divide_by_the_data_parallel_size_as_verl():
    """veRL's workers: per_gpu = global // (world_size // ulysses_sequence_parallel_size)."""
    for world, sp in ((2, 1), (4, 1), (4, 2)):
        cfg = _config({"algorithm.adv_estimator": "gae", "data.train_batch_size": 16,
                       "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
                       "actor_rollout_ref.actor.ppo_micro_batch_size": 8,
                       "actor_rollout_ref.actor.ulysses_sequence_parallel_size": sp,
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size": 8,
                       "actor_rollout_ref.ref.log_prob_micro_batch_size": 4,
                       "actor_rollout_ref.ref.ulysses_sequence_parallel_size": sp,
                       "actor_rollout_ref.actor.use_kl_loss": True,
                       "critic.ppo_micro_batch_size": 8})
        resolved = plan_run(cfg, world, notice=None).config
        assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size == 8  # the user's config is not written
        cfg = resolved
        arr, dp = cfg.actor_rollout_ref, world // sp
        assert arr.actor.ppo_micro_batch_size_per_gpu == 8 // dp
        assert arr.rollout.log_prob_micro_batch_size_per_gpu == 8 // dp
        assert arr.ref.log_prob_micro_batch_size_per_gpu == 4 // dp
        assert cfg.critic.ppo_micro_batch_size_per_gpu == 8 // world
        assert cfg.critic.forward_micro_batch_size_per_gpu == 8 // world  # veRL: forward follows ppo's
        assert arr.actor.ppo_micro_batch_size is None  # converted once: a second plan changes nothing
        again = plan_run(cfg, world, notice=None).config
        assert again.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8 // dp


def test_global_and_per_gpu_micro_batch_together_are_refused():
    with pytest.raises(ValueError, match="remove actor_rollout_ref.actor.ppo_micro_batch_size"):
        _config({"actor_rollout_ref.actor.ppo_micro_batch_size": 8,
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4})


def test_global_micro_batch_below_one_row_per_rank_is_refused():
    cfg = _config({"data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
                   "actor_rollout_ref.ref.log_prob_micro_batch_size": 1})
    with pytest.raises(ConfigError, match="log_prob_micro_batch_size_per_gpu"):
        plan_run(cfg, 2, notice=None)


def test_gpus_per_node_times_nodes_must_be_the_torchrun_world():
    cfg = _config({"data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
                   "trainer.n_gpus_per_node": 8, "trainer.nnodes": 1})
    with pytest.raises(ConfigError) as e:
        plan_run(cfg, 2, notice=None)
    msg = str(e.value)
    assert "trainer.n_gpus_per_node=8" in msg and "torchrun started 2" in msg and "--nproc_per_node 8" in msg
    assert "\n" not in msg
    cfg = _config({"data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
                   "trainer.n_gpus_per_node": 2, "trainer.nnodes": 2})
    plan_run(cfg, 4, notice=None)


def test_filter_overlong_prompts_wins_over_truncation_as_in_verl():
    cfg = _config({"data.filter_overlong_prompts": True, "data.truncation": "error"})
    assert cfg.data.truncation == "filter"


def test_rollout_correction_sets_tinyzeros_corrections():
    cfg = _config({"algorithm.rollout_correction.rollout_is": "token",
                   "algorithm.rollout_correction.rollout_is_threshold": 3.0,
                   "algorithm.rollout_correction.bypass_mode": True})
    assert cfg.actor_rollout_ref.actor.tis_imp_ratio_cap == 3.0
    assert cfg.actor_rollout_ref.rollout.use_rollout_log_probs
    with pytest.raises(ConfigError, match="rollout_is"):
        _config({"algorithm.rollout_correction.rollout_is": "sequence"})


def test_a_list_of_parquet_files_keeps_each_rows_data_source(tmp_path, tiny_model_dir):
    from tinyzero.data.config import DataConfig
    from tinyzero.data.preprocess.common import make_row, write_parquet
    from tinyzero.data.rl_dataset import RLHFDataset
    from tinyzero.models.loading import load_tokenizer

    files = []
    for source, n in (("openai/gsm8k", 3), ("lighteval/MATH", 2)):
        rows = [make_row(source, f"{source} question {i}", str(i), "train", i) for i in range(n)]
        files.append(str(tmp_path / f"{source.replace('/', '_')}.parquet"))
        write_parquet(rows, files[-1])
    cfg = _config({"data.train_files": files, "data.max_prompt_length": 64})
    ds = RLHFDataset(cfg.data.train_files, load_tokenizer(tiny_model_dir), DataConfig(max_prompt_length=64))
    items = [ds[i] for i in range(len(ds))]
    assert [it["data_source"] for it in items] == ["openai/gsm8k"] * 3 + ["lighteval/MATH"] * 2
    assert [it["reward_model"]["ground_truth"] for it in items] == ["0", "1", "2", "0", "1"]


# --------------------------------------------------------------------------- end to end

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def verl_data(tmp_path_factory):
    """Countdown (TinyZero) and gsm8k-style (veRL's examples) parquet files, a few rows each."""
    from tinyzero.data.preprocess.common import make_row, write_splits

    root = tmp_path_factory.mktemp("verl_data")
    subprocess.run([sys.executable, "-m", "tinyzero.data.preprocess.countdown", "--out", str(root / "countdown"),
                    "--train_size", "16", "--test_size", "4"], check=True, capture_output=True, cwd=ROOT)
    rows = [make_row("openai/gsm8k", f"What is {i} + {i}? Answer after ####.", str(2 * i), "train", i)
            for i in range(16)]
    write_splits(str(root / "gsm8k"), rows[:12], rows[12:])
    return root


CPU_SCALE = ["data.train_batch_size=4", "data.val_batch_size=4", "data.max_response_length=16",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.name=native",
             "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.total_training_steps=2",
             "trainer.logger=['console','jsonl']", "trainer.n_gpus_per_node=2", "trainer.device=cpu",
             "trainer.plot=false", "trainer.export_hf=false"]


@pytest.mark.slow
@pytest.mark.parametrize("name, data, extra", [
    ("train_tiny_zero.txt", "countdown", ["data.max_prompt_length=640", "data.apply_chat_template=false",
                                                    "critic.ppo_micro_batch_size=4"]),
    ("grpo_qwen2-7b.txt", "gsm8k", ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                    "actor_rollout_ref.rollout.n=2"]),
    ("ppo_deepseek7b_llm.txt", "gsm8k", ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                         "critic.ppo_micro_batch_size_per_gpu=2"]),
    ("grpo_lora_qwen2_5-3b.txt", "gsm8k", ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                           "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.model.lora_rank=4"]),
])
@pytest.mark.slow
def test_script_trains_two_steps_on_two_cpu_ranks(name, data, extra, verl_data, tiny_model_dir, tmp_path):
    from tinyzero.trainer.loggers import read_metrics

    data_dir = verl_data / data
    args = _script_args(name, {"$DATA_DIR": str(data_dir), "$HOME/data/gsm8k": str(data_dir),
                               "$BASE_MODEL": tiny_model_dir, "$N_GPUS": "2", "$ROLLOUT_TP_SIZE": "1",
                               "$EXPERIMENT_NAME": "e2e"})
    args = [f"{a.split('=', 1)[0]}={tiny_model_dir}" if a.split("=", 1)[0].endswith("model.path") else a
            for a in args]  # the scripts' hub names are paths too: the tiny model stands in
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), *args, *CPU_SCALE, *extra, f"trainer.default_local_dir={run}"]
    out = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    steps = [r for r in read_metrics(str(run)) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]


def test_sandbox_fusion_keys_reach_the_code_sandbox():
    """veRL's reward_model.sandbox_fusion.{url, max_concurrent, memory_limit_mb} drive the SandboxFusion client."""
    from tinyzero.cli import parse_args

    cfg = parse_args(["reward_model.sandbox_fusion.url=http://127.0.0.1:8080/run_code",
                      "reward_model.sandbox_fusion.max_concurrent=8", "reward_model.sandbox_fusion.memory_limit_mb=512"])
    sandbox = cfg.reward.sandbox
    assert (sandbox.url, sandbox.max_concurrent, sandbox.memory_limit_mb) == ("http://127.0.0.1:8080/run_code", 8, 512)
