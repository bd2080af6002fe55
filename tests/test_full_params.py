"""Weight sync: full HF-named tensors streamed from plain, wrapped and FSDP2-sharded models."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tinyzero.distributed import full_params as weight_sync
from tinyzero.distributed.full_params import clean_param_name, iter_full_params


def _model(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def test_names_and_values_plain_and_wrapped():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _model()
    ref = model.state_dict()  # the tied lm_head.weight is yielded too (same tensor as embed_tokens)
    got = dict(iter_full_params(model, bucket_bytes=1 << 20))
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    wrapped = torch.compile(model)
    names = [n for n, _ in iter_full_params(wrapped, bucket_bytes=1 << 20)]
    assert names == list(got)
    assert clean_param_name("module._orig_mod.model._fsdp_wrapped_module.norm.weight") == "model.norm.weight"
    bf16 = dict(iter_full_params(model, bucket_bytes=1 << 20, dtype=torch.bfloat16))
    assert all(v.dtype == torch.bfloat16 for v in bf16.values())


def test_buckets_are_gathered_lazily(monkeypatch):
    model = _model()
    calls = []
    real = weight_sync._gather
    monkeypatch.setattr(weight_sync, "_gather", lambda t, dtype: calls.append(t.numel()) or real(t, dtype))
    bucket = 40_000  # bytes: a few of the tiny model's tensors per bucket
    it = iter_full_params(model, bucket_bytes=bucket)
    max_in_flight = 0
    yielded = 0
    for name, t in it:
        if name != "lm_head.weight":  # tied to embed_tokens: yielded under both names, gathered once
            yielded += t.numel()
        gathered = sum(calls)
        # Never more than one bucket (or one oversize tensor) gathered ahead of the consumer.
        max_in_flight = max(max_in_flight, (gathered - yielded) * 4)
    assert max_in_flight <= max(bucket, max(p.numel() * 4 for p in model.parameters()))
    assert sum(calls) == sum(p.numel() for p in model.parameters())


def _fsdp_sync_worker(bucket_bytes: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tinyzero.protocol import DataProto
    from tinyzero.rollout import RolloutConfig
    from tinyzero.rollout.native import NativeRollout

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    reference = _model(seed=3)
    sharded = _model(seed=3)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    local = sum(p.to_local().numel() for p in sharded.parameters())
    total = sum(p.numel() for p in reference.parameters())
    got = dict(iter_full_params(sharded, bucket_bytes=bucket_bytes))
    ref = reference.state_dict()
    same = all(torch.equal(got[k], ref[k]) for k in got) and set(got) == set(ref)
    # The hybrid engine path: FSDP2 shards -> inference copy -> greedy generation.
    engine = NativeRollout(RolloutConfig(response_length=8, do_sample=False), reference.config, "cpu")
    engine.update_weights(iter_full_params(sharded, bucket_bytes=bucket_bytes))
    ids = torch.randint(2, 96, (2, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    mask = torch.ones_like(ids)
    out = engine.generate_sequences(DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(1) - 1},
        meta_info={"eos_token_id": 1, "pad_token_id": 0}))
    ref_out = reference.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                 eos_token_id=1, pad_token_id=0)[:, 5:]
    gen_ok = torch.equal(out.batch["responses"][:, : ref_out.shape[1]], ref_out)
    return same, gen_ok, local < total


@pytest.mark.slow
def test_fsdp2_two_ranks_full_params_and_engine_sync():
    results = run_distributed(_fsdp_sync_worker, 2, 30_000, timeout=240)
    for same, gen_ok, is_sharded in results:
        assert is_sharded
        assert same
        assert gen_ok
