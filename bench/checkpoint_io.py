"""Model init, checkpoint and HF-export timings of an FSDP2 model on gloo CPU ranks.

    python bench/checkpoint_io.py                          # 2 ranks, hidden 512, 8 layers (~30M params)
    python bench/checkpoint_io.py --ranks 2 --hidden 256 --layers 4 --rounds 3

For a random Qwen2 written to a temporary folder, each rank (1 thread) times, per round:
  init_direct_s      every rank reads the safetensors, then parallelize()
  init_meta_s        load_sharded_model(): meta init, only rank 0 reads, tensors broadcast
  save_s             save_state (DCP model + AdamW state) + RNG + trainer state + finalize
                     (fsync, sha256 manifest, atomic rename)
  resume_s           resolve_resume("auto") (rank 0 verifies checksums) + load_state
  export_s           export_hf (one tensor gathered at a time, rank 0 writes safetensors)
Medians over rounds are reported, with checkpoint MB and save/load MB/s.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t, out


def _one_round(r: int, model_dir: str, work: str, mesh, fsdp_cfg, model_cfg) -> dict:
    from tinyzero.models.fsdp import load_sharded_model, parallelize
    from tinyzero.models.hf_export import export_hf
    from tinyzero.models.loading import load_causal_lm
    from tinyzero.trainer.checkpoint import (
        CheckpointManager,
        load_state,
        save_rng_state,
        save_state,
        save_trainer_state,
    )

    t_direct, _ = _timed(lambda: parallelize(load_causal_lm(model_dir), mesh, fsdp_cfg))
    t_meta, model = _timed(lambda: load_sharded_model(model_cfg, fsdp_cfg, mesh))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.randint(0, 250, (1, 16))).logits.mean().backward()
    optim.step()
    mgr = CheckpointManager(os.path.join(work, f"ckpt_{r}"), keep_last=1)

    def save():
        tmp = mgr.begin_save(1)
        save_state(os.path.join(tmp, "actor"), model, optim)
        save_rng_state(tmp)
        save_trainer_state(tmp, {"global_step": 1})
        return mgr.finalize(1, tmp)

    t_save, final = _timed(save)
    t_resume, _ = _timed(lambda: load_state(os.path.join(mgr.resolve_resume("auto"), "actor"), model, optim))
    t_export, _ = _timed(lambda: export_hf(model, os.path.join(work, f"hf_{r}")))
    return dict(init_direct_s=t_direct, init_meta_s=t_meta, save_s=t_save, resume_s=t_resume,
                export_s=t_export, ckpt_bytes=_dir_bytes(final))


def _rank_main(rank: int, world: int, port: int, model_dir: str, work: str, rounds: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import warnings

    import torch.distributed as dist

    from tinyzero.distributed import init_distributed
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.fsdp import make_fsdp_mesh

    warnings.filterwarnings("ignore")
    init_distributed()
    fsdp_cfg = FSDPConfig()
    mesh = make_fsdp_mesh(fsdp_cfg, "cpu")
    model_cfg = ModelConfig(path=model_dir, enable_gradient_checkpointing=False)
    rows = [_one_round(r, model_dir, work, mesh, fsdp_cfg, model_cfg) for r in range(rounds)]
    if dist.get_rank() == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp

    from tinyzero.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as work:
        model_dir = build_tiny_model(os.path.join(work, "model"), seed=0, hidden_size=args.hidden,
                                     num_layers=args.layers, num_heads=8, num_kv_heads=2,
                                     intermediate_size=4 * args.hidden)
        n_params = sum(v.numel() for v in __import__("safetensors.torch").torch.load_file(
            os.path.join(model_dir, "model.safetensors")).values())
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, args.ranks, port, model_dir, work, args.rounds, queue))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=1800)
        for p in procs:
            p.join()
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    mb = med["ckpt_bytes"] / 2**20
    result = {
        "ranks": args.ranks, "params": n_params, "rounds": args.rounds,
        "init_direct_s": round(med["init_direct_s"], 3), "init_meta_broadcast_s": round(med["init_meta_s"], 3),
        "ckpt_mb": round(mb, 1), "save_s": round(med["save_s"], 3), "save_mb_per_s": round(mb / med["save_s"], 1),
        "resume_s": round(med["resume_s"], 3), "resume_mb_per_s": round(mb / med["resume_s"], 1),
        "hf_export_s": round(med["export_s"], 3),
    }
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
