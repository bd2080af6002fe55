"""Packed shared-prefix training passes: segment-by-segment attention against the dense 4-D mask.

    python bench/packed_attention.py                        # the tiny model, three GRPO group shapes
    python bench/packed_attention.py --model runs/real/smollm2-135m-instruct --shapes 4x4x60x48

One process, 1 thread. A micro-batch of G groups, each a prompt of P tokens with n sampled responses
of about R tokens (lengths spread over [R/2, 3R/2], capped at 2R), goes through the actor's packed
log-prob pass (`use_shared_prefix`) forward and backward, with a token-mean loss:
  dense     the model on HF's SDPA with the packed rows' dense boolean mask (rows, 1, L, L)
  segments  the model after `prepare_attention` (tinyzero_packed_sdpa: each segment's queries
            against its prompt's and its own keys, gathered)
The two are timed interleaved (A B A B, --rounds pairs, --iters passes each after one warm-up),
and their log-probs compared (max_abs_diff). A shape is GxnxPxR. The last line printed is one
JSON object: per shape the packed tokens, both medians in seconds and segments / dense.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

DEFAULT_SHAPES = ("4x4x90x48", "2x8x90x64", "1x16x90x200")  # the vs_trl shape per rank, then larger n and R


def group_batch(vocab: int, groups: int, n: int, prompt: int, response: int, seed: int = 0) -> dict:
    """Left-padded prompts (lengths prompt - 3g), each repeated n times with its own response lengths."""
    g = torch.Generator().manual_seed(seed)
    width = 2 * response
    rows = groups * n
    ids = torch.zeros(rows, prompt + width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i in range(groups):
        length = max(1, prompt - 3 * i)
        tokens = torch.randint(0, vocab, (length,), generator=g)
        for j in range(n):
            r = i * n + j
            ids[r, prompt - length:prompt], attn[r, prompt - length:prompt] = tokens, 1
            k = int(torch.randint(response // 2, response + response // 2 + 1, (1,), generator=g))
            k = max(1, min(width, k))
            ids[r, prompt:prompt + k] = torch.randint(0, vocab, (k,), generator=g)
            attn[r, prompt:prompt + k] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": ids[:, prompt:]}


def time_pass(model, batch: dict, iters: int) -> tuple[float, torch.Tensor]:
    """Median seconds of a forward + backward of the packed log-prob pass; the log-probs."""
    from tinyzero.workers.forward import response_log_probs

    mask = batch["attention_mask"][:, -batch["responses"].shape[1]:].float()
    times = []
    for i in range(iters + 1):
        start = time.perf_counter()
        lp, _ = response_log_probs(model, batch, 1.0, False, "shared_prefix")
        (-(lp * mask).sum() / mask.sum()).backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times), lp.detach()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="an HF causal-LM folder (default: the offline tiny model)")
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="GxnxPxR (groups, samples, "
                   "prompt tokens, mean response tokens)")
    p.add_argument("--rounds", type=int, default=2, help="dense, segments pairs")
    p.add_argument("--iters", type=int, default=3, help="timed passes per side and round")
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from tinyzero.workers.forward import attach_log_prob_method
    from tinyzero.workers.packing import PACKED_ATTENTION, pack, prepare_attention

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from tinyzero.models.tiny import build_tiny_model

            path = os.path.join(tmp, "tiny")
            build_tiny_model(path)
        dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    segments = copy.deepcopy(dense)
    prepare_attention(segments, "shared_prefix")
    assert segments.config._attn_implementation == PACKED_ATTENTION
    models = {"dense": attach_log_prob_method(dense), "segments": attach_log_prob_method(segments)}
    results = {}
    for shape in args.shapes:
        groups, n, prompt, response = (int(x) for x in shape.split("x"))
        batch = group_batch(dense.config.vocab_size, groups, n, prompt, response)
        packed = pack(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                      batch["responses"].shape[1], share_prefix=True)
        times = {"dense": [], "segments": []}
        out = {}
        for _ in range(args.rounds):
            for name, model in models.items():
                t, out[name] = time_pass(model, batch, args.iters)
                times[name].append(t)
        med = {k: statistics.median(v) for k, v in times.items()}
        results[shape] = {"packed_tokens": int((packed.segments >= 0).sum()), "packed_row_length": packed.segments.shape[1],
                          "dense_s": round(med["dense"], 4), "segments_s": round(med["segments"], 4),
                          "segments_over_dense": round(med["segments"] / med["dense"], 3),
                          "max_abs_diff": float((out["segments"] - out["dense"]).abs().max())}
        print(shape, results[shape], flush=True)
    print(json.dumps({"model": args.model or "tiny", "threads": 1, "shapes": results}))


if __name__ == "__main__":
    main()
