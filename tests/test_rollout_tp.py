"""Tensor-parallel decode in the native engine (rollout.tensor_model_parallel_size > 1).

Two gloo ranks hold the same batch; each attends for half of the prompts' rows and computes half of
every MLP and of lm_head's vocabulary (fused decoder). Against the same engine on one rank alone, per
case: the same tokens and response masks, log-probs within fp32 rounding (1e-5: the MLP's sums are
split in two), and the very same output on both ranks. Cases: prefix sharing shared / copy / off,
greedy and sampled, rows leaving the batch at different steps (compaction), a vocabulary the ranks
do not split evenly, both exchanges (shared memory, gloo), and a batch whose prompts do not split
evenly (every rank then decodes it alone).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_rollout_native import _prompt_batch, _random_model


def _tp_rank(mode: str, do_sample: bool, comm_kind: str, vocab: int, prompts: int, compact: bool):
    import torch.distributed as dist

    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.rollout.native import NativeRollout
    from tinyzero.rollout.native.tp_comm import DistComm, ShmComm

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = _random_model(std=0.15)
    if vocab != model.config.vocab_size:  # a vocabulary 2 does not divide: the last block is shorter
        from transformers import Qwen2ForCausalLM

        model.config.vocab_size = vocab
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(model.config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0, 0.15)
    meta = {"eos_token_id": 1, "stop_token_ids": list(range(2, 10)), "seed": 3}
    batch = _prompt_batch(prompts, 7, vocab, meta=meta)
    cfg = dict(native_impl="fused", native_prefix_sharing=mode, response_length=20, n=3, seed=5, do_sample=do_sample)
    outs = {}
    for tp in (False, True):
        engine = NativeRollout(RolloutConfig(**cfg), model.config, "cpu")
        if tp:
            engine.tp_comm = ShmComm(dist.group.WORLD) if comm_kind == "shm" else DistComm(dist.group.WORLD)
            engine._split_decoder()
        engine.update_weights(model.state_dict().items())
        engine.decoder.takes_active_rows = compact  # the tiny model's width would not compact by itself
        out = engine.generate_sequences(batch).batch
        outs[tp] = {k: out[k].tolist() for k in ("responses", "response_mask", "rollout_log_probs")}  # pickled back
        outs[tp]["tp_on"] = engine.decoder.tp_on
        outs[tp]["cache_rows"] = engine.decoder.caches[0].k_cache.shape[0]
    return outs


CASES = [  # mode, do_sample, exchange, vocab, prompts, compact
    ("shared", True, "shm", 96, 4, True),
    ("shared", False, "shm", 96, 4, False),
    ("copy", True, "shm", 97, 4, True),
    ("off", True, "gloo", 96, 2, True),
    ("shared", True, "gloo", 97, 4, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode,do_sample,exchange,vocab,prompts,compact", CASES)
def test_tensor_parallel_decode_gives_the_single_rank_samples(mode, do_sample, exchange, vocab, prompts, compact):
    ranks = run_distributed(_tp_rank, 2, mode, do_sample, exchange, vocab, prompts, compact, timeout=240)
    ranks = [{tp: {k: torch.tensor(v) if isinstance(v, list) else v for k, v in o.items()} for tp, o in outs.items()}
             for outs in ranks]
    for outs in ranks:
        alone, split = outs[False], outs[True]
        assert split["tp_on"] and not alone["tp_on"]
        assert split["cache_rows"] * 2 == alone["cache_rows"]  # each rank caches half of the rows
        lengths = alone["response_mask"].sum(-1)
        assert len(set(lengths.tolist())) > 2  # rows stop at different steps
        assert torch.equal(split["responses"], alone["responses"])
        assert torch.equal(split["response_mask"], alone["response_mask"])
        diff = (split["rollout_log_probs"] - alone["rollout_log_probs"]).abs().max()
        assert diff < 1e-5, float(diff)
    for key in ("responses", "response_mask", "rollout_log_probs"):  # the very same output on both ranks
        assert torch.equal(ranks[0][True][key], ranks[1][True][key])


@pytest.mark.slow
def test_uneven_prompts_decode_alone_on_every_rank():
    """3 prompts do not split over 2 ranks: each rank decodes the batch alone, with the same result."""
    ranks = run_distributed(_tp_rank, 2, "shared", True, "shm", 96, 3, True, timeout=240)
    for outs in ranks:
        assert not outs[True]["tp_on"] and outs[True]["cache_rows"] == outs[False]["cache_rows"]
        assert outs[True]["responses"] == outs[False]["responses"]
        assert outs[True]["rollout_log_probs"] == outs[False]["rollout_log_probs"]
