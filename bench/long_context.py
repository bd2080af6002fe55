"""Peak memory of a long-sequence forward + backward at Ulysses sp=1 vs sp=2 (CPU, 2 gloo ranks).

    python bench/long_context.py                     # 8192 tokens of the tiny model, cap 96 MiB
    python bench/long_context.py --seq 1024 --cap_mib 64

One row of `--seq` tokens (prompt + `--seq // 8` response tokens) of the offline tiny Qwen2
(fp32, hidden 64, 4 heads, 2 kv heads): response log-probs (tinyzero.workers.forward's
response_log_probs, the actor's path), a token-mean loss, backward. sp=1 is the plain model on
one rank; sp=2 is the same batch split over 2 ranks (tinyzero.models.ulysses).

What is measured, per rank:
- live_peak_bytes: the peak of the bytes of tensor storages allocated during forward + backward
  and still alive, counted by a TorchDispatchMode (`LiveTensorBytes`) that sees every op's output
  and a weakref finaliser on every new storage. Deterministic (byte counting, not sampling); it
  counts activations, temporaries, gradients and communication buffers, not the weights or
  inputs made before, nor memory the allocator keeps cached.
- rss_peak_delta_bytes: the process's peak resident memory (VmHWM, reset through
  /proc/self/clear_refs before the run) minus the resident memory before it: what the OS saw,
  including allocator slack; null where the reset is not permitted.
The cap: sp=1 "exceeds" it when its live peak is above `--cap_mib`, sp=2 "fits" when below.
Measured on a loaded 2-core CPU (deterministic bytes): 1024 tokens 15.6 vs 8.7 MiB, 4096 tokens
60.4 vs 32.6 MiB, 8192 tokens 120.2 vs 64.6 MiB (ratio 0.54; linear in the length, as CPU SDPA
keeps no S x S scores here). bench/train_scaling.py reports the same measurement (`sp_peak_memory`).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Tracks the bytes of storages created inside the mode that are still alive; `peak` is their max."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def _freed(self, key: int, nbytes: int):
        self._refs.pop(key, None)
        self.live -= nbytes

    def _track(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, k=key, n=nbytes: self._freed(k, n))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t)
        return out


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def long_batch(seq: int, vocab: int, seed: int = 0) -> dict:
    """One row of `seq` real tokens: prompt of seq - seq // 8, response of seq // 8."""
    g = torch.Generator().manual_seed(seed)
    r = seq // 8
    ids = torch.randint(3, vocab, (1, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(1, seq, dtype=torch.long),
            "position_ids": torch.arange(seq)[None], "responses": ids[:, seq - r:]}


def measure(model_dir: str, seq: int, group) -> dict:
    """Forward + backward of a token-mean log-prob loss; peak bytes (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    from tinyzero.models.ulysses import attach_sp_log_prob_method
    from tinyzero.workers.forward import attach_log_prob_method, response_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    model = attach_log_prob_method(model) if group is None else attach_sp_log_prob_method(model, group)
    batch = long_batch(seq, model.config.vocab_size)
    reset = _reset_rss_peak()
    before = _rss_bytes("VmRSS")
    with LiveTensorBytes() as mem:
        log_probs, _ = response_log_probs(model, batch, 1.0, False)
        (-log_probs.mean()).backward()
        del log_probs
    return {"live_peak_bytes": mem.peak, "rss_peak_delta_bytes": _rss_bytes("VmHWM") - before if reset else None}


def peak_bytes(model_dir: str, seq: int, group) -> int:
    """Live tensor peak of `measure` (the deterministic number tests assert on)."""
    return measure(model_dir, seq, group)["live_peak_bytes"]


def _rank(rank: int, world: int, port: int, model_dir: str, seq: int, out_dir: str):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        for warm in (group, None):  # first-call allocations (gloo buffers, lazy imports) stay out of the RSS figures
            measure(model_dir, 256, warm)
        res = {"sp2": measure(model_dir, seq, group)}
        dist.barrier()
        if rank == 0:  # sp=1 on one rank, after the sp=2 run (a fresh measurement window)
            res["sp1"] = measure(model_dir, seq, None)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def sp_peak_memory(seq: int, cap_mib: float) -> dict:
    """Live peak bytes of one `seq`-token row at sp=1 (one rank) and sp=2 (2 gloo ranks, the busier one),
    and the verdict against `cap_mib` (see the module docstring)."""
    import socket

    import torch.multiprocessing as mp

    from tinyzero.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), seed=0, max_position_embeddings=max(seq, 2048))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(2, port, model_dir, seq, tmp), nprocs=2, join=True)
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(2)]
    sp1 = ranks[0]["sp1"]["live_peak_bytes"]
    sp2 = max(r["sp2"]["live_peak_bytes"] for r in ranks)
    cap = cap_mib * 2**20
    return {"seq": seq, "model": "tiny qwen2 fp32 (hidden 64, 4 heads, 2 kv heads)",
            "sp1_live_peak_mib": round(sp1 / 2**20, 2), "sp2_live_peak_mib_per_rank": round(sp2 / 2**20, 2),
            "sp2_over_sp1": round(sp2 / sp1, 3),
            "sp1_rss_peak_delta_mib": _mib(ranks[0]["sp1"]["rss_peak_delta_bytes"]),
            "sp2_rss_peak_delta_mib_per_rank": [_mib(r["sp2"]["rss_peak_delta_bytes"]) for r in ranks],
            "cap_mib": cap_mib, "sp1_exceeds_cap": sp1 > cap, "sp2_fits_cap": sp2 <= cap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192, help="tokens in the row (prompt + response)")
    parser.add_argument("--cap_mib", type=float, default=96.0,
                        help="memory cap (MiB) for the fits / exceeds verdict; 96 sits between sp=1 and sp=2 at 8192")
    args = parser.parse_args()
    res = sp_peak_memory(args.seq, args.cap_mib)
    print(f"seq {args.seq}: live peak sp=1 {res['sp1_live_peak_mib']:.1f} MiB, "
          f"sp=2 {res['sp2_live_peak_mib_per_rank']:.1f} MiB per rank (cap {args.cap_mib:.0f} MiB)")
    print(json.dumps({"bench": "long_context", **res}))


def _mib(n):
    return None if n is None else round(n / 2**20, 2)


if __name__ == "__main__":
    main()
