"""Training throughput of `update_actor`: 1 vs 2 CPU ranks (scaling), and MFU on a GPU.

    python bench/train_scaling.py                       # CPU: 1 vs 2 gloo ranks, 1 thread each
    python bench/train_scaling.py --hidden 256 --layers 4 --rows 32 --seq 256 --rounds 2
    python bench/train_scaling.py --gpu                 # also MFU of a 0.5B-shaped model when CUDA exists

CPU part: a random Qwen2 (hidden 256, 4 layers by default, so matmuls dominate over the
per-layer FSDP collectives) is trained with the real ActorRolloutRefWorker (FSDP2 over
gloo, PPO loss, AdamW, grad clipping) on one fixed global batch. Runs of 1 rank and of 2
ranks alternate (A B A B ...) in fresh process groups; each run times `steps` calls of
update_actor after a warm-up. tokens/s counts the real (unpadded) prompt+response tokens
of the global batch per second; scaling_2_ranks = median tokens/s on 2 ranks / on 1 rank
(ideal 2.0). On a machine shared with other jobs the wall clock also measures how often
the scheduler runs both ranks at once, so the CPU seconds of the busiest rank per step are
reported too: work_scaling_2_ranks = CPU s (1 rank) / CPU s (busiest of 2 ranks), the
scaling idle cores would show. Defaults: one micro-batch per rank and ZeRO-2 style
sharding (layers stay gathered until backward), which halves the collectives per step.

GPU part (when CUDA is available and --gpu or no CPU-only flag): update_actor of a
Qwen2.5-0.5B-shaped random model (hidden 896, 24 layers, vocab 151936) in bf16 on one GPU;
MFU = achieved model FLOPs (6 x non-embedding params x tokens + causal attention + lm_head)
/ the device's peak dense bf16 FLOPs.

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

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """A PPO batch with varied prompt/response lengths (left/right padded)."""
    from tinyzero.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    p, r = prompt_len, response_len
    ids = torch.randint(3, vocab, (rows, p + r), generator=g)
    attn = torch.zeros(rows, p + r, dtype=torch.long)
    for i in range(rows):
        lp = p - (i * 7) % max(p // 4, 1)
        lr = r - (i * 13) % max(r // 3, 1)
        attn[i, p - lp:p] = 1
        attn[i, p:p + lr] = 1
    ids = ids * attn
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    mask = attn[:, p:].float()
    tensors = {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": ids[:, p:],
               "response_mask": mask, "advantages": torch.randn(rows, r, generator=g) * mask,
               "old_log_probs": -5.0 + 0.1 * torch.randn(rows, r, generator=g)}
    return DataProto.from_dict(tensors, meta_info={"temperature": 1.0}), int(attn.sum())


def actor_config(model_dir: str, rows: int, micro: int, seq: int, grad_ckpt: bool, reshard: bool):
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.workers.config import ActorConfig, ActorRolloutRefConfig, OptimConfig

    actor = ActorConfig(ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=micro, grad_clip=1.0,
                        optim=OptimConfig(lr=1e-6), fsdp_config=FSDPConfig(reshard_after_forward=reshard))
    return ActorRolloutRefConfig(model=ModelConfig(path=model_dir, enable_gradient_checkpointing=grad_ckpt),
                                 actor=actor, rollout=RolloutConfig(n=1, prompt_length=seq // 4,
                                                                    response_length=seq - seq // 4))


def timed_updates(model_dir: str, args, device_kind: str) -> dict:
    """In an initialised process group: build the actor, warm up, time `steps` updates (rank-0 clock)."""
    import torch.distributed as dist

    from tinyzero.workers.actor_worker import ActorRolloutRefWorker

    world = dist.get_world_size()
    micro = max(1, args.rows // world // args.micro_batches)
    cfg = actor_config(model_dir, args.rows, micro, args.seq, grad_ckpt=False, reshard=args.reshard_after_forward)
    worker = ActorRolloutRefWorker(cfg, "actor")
    worker.init_model()
    vocab = worker.actor.model.config.vocab_size
    batch, tokens = make_batch(args.rows, args.seq // 4, args.seq - args.seq // 4, vocab)
    local = batch.chunk(world)[worker.rank] if world > 1 else batch
    worker.update_actor(local)  # warm-up
    times, cpu_times = [], []
    for _ in range(args.steps):
        if device_kind == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        worker.update_actor(local)
        if device_kind == "cuda":
            torch.cuda.synchronize()
        cpu_times.append(time.process_time() - c0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    # CPU seconds this rank spent per step: on a shared machine it shows the work each rank does,
    # whatever share of the cores the scheduler gave it.
    cpu = torch.tensor([statistics.median(cpu_times)], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    return {"world_size": world, "step_s": step_s, "tokens": tokens, "tokens_per_s": tokens / step_s,
            "max_rank_cpu_s_per_step": float(cpu), "num_params": sum(p.numel() for p in worker.actor.model.parameters())}


def _rank_entry(rank: int, world: int, port: int, model_dir: str, args, out_file: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from tinyzero.distributed import cleanup, init_distributed

    init_distributed()
    try:
        res = timed_updates(model_dir, args, "cpu")
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(res, f)
    finally:
        cleanup()


def cpu_run(world: int, model_dir: str, args) -> dict:
    """One fresh group of `world` CPU ranks; returns rank 0's timing."""
    import torch.multiprocessing as mp

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_file = f.name
    mp.start_processes(_rank_entry, args=(world, _free_port(), model_dir, args, out_file), nprocs=world,
                       join=True, start_method="spawn")
    with open(out_file) as f:
        res = json.load(f)
    os.unlink(out_file)
    return res


def cpu_scaling(args) -> dict:
    from tinyzero.models.tiny import build_tiny_model

    model_dir = tempfile.mkdtemp(prefix="train_scaling_")
    build_tiny_model(model_dir, seed=0, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                     num_kv_heads=2, intermediate_size=4 * args.hidden)
    one, two = [], []
    for _ in range(args.rounds):  # A B A B: both see the same background load on a shared machine
        one.append(cpu_run(1, model_dir, args))
        two.append(cpu_run(2, model_dir, args))
        print(json.dumps({"round_1_rank": one[-1], "round_2_ranks": two[-1]}), file=sys.stderr)
    t1, t2 = (statistics.median(r["tokens_per_s"] for r in runs) for runs in (one, two))
    c1, c2 = (statistics.median(r["max_rank_cpu_s_per_step"] for r in runs) for runs in (one, two))
    return {"cpu_model": f"qwen2 hidden={args.hidden} layers={args.layers}", "rows": args.rows, "seq": args.seq,
            "tokens_per_s_1_rank": round(t1, 1), "tokens_per_s_2_ranks": round(t2, 1),
            "scaling_2_ranks": round(t2 / t1, 3),
            # CPU time of the busiest rank: 1-rank / 2-rank is the scaling idle cores would give
            # (it excludes time a rank spends descheduled on a loaded machine).
            "cpu_s_per_step_1_rank": round(c1, 3), "cpu_s_per_step_2_ranks": round(c2, 3),
            "work_scaling_2_ranks": round(c1 / c2, 3), "load_avg_1min": round(os.getloadavg()[0], 2),
            "rounds": args.rounds}


def model_flops_per_token(cfg, seq: int) -> float:
    """Training FLOPs per token: 6 x matmul params (layers + lm_head) + causal attention scores."""
    h, layers, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter  # q, k, v, o, gate/up/down
    matmul_params = layers * per_layer + cfg.vocab_size * h
    attention = 6 * layers * h * seq  # 12 * L * h * seq, halved by the causal mask
    return 6.0 * matmul_params + attention


def gpu_mfu(args) -> dict:
    """update_actor MFU of a Qwen2.5-0.5B-shaped random model on one GPU (bf16 compute, fp32 master)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tinyzero.distributed import cleanup, init_distributed
    from tinyzero.models.loading import load_tokenizer
    from tinyzero.models.tiny import build_tiny_model

    model_dir = tempfile.mkdtemp(prefix="train_mfu_")
    # The offline byte-level tokenizer (token ids of the batch are random over the full vocab anyway).
    load_tokenizer(build_tiny_model(tempfile.mkdtemp(prefix="train_mfu_tok_"))).save_pretrained(model_dir)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, rope_theta=1e6)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    init_distributed()
    try:
        gargs = argparse.Namespace(**{**vars(args), "rows": args.gpu_rows, "seq": args.gpu_seq,
                                      "micro_batches": args.gpu_micro_batches})
        res = timed_updates(model_dir, gargs, "cuda")
    finally:
        cleanup()
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    # Padded positions are computed too, but MFU counts only real tokens (the useful work).
    achieved = res["tokens_per_s"] * model_flops_per_token(cfg, args.gpu_seq) / 1e12
    return {"gpu": name, "gpu_tokens_per_s": round(res["tokens_per_s"], 1), "gpu_step_s": round(res["step_s"], 3),
            "gpu_achieved_tflops": round(achieved, 1), "gpu_peak_tflops": peak,
            "gpu_mfu": round(achieved / peak, 4) if peak else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32, help="global batch rows (one mini-batch)")
    ap.add_argument("--seq", type=int, default=256, help="prompt + response length")
    ap.add_argument("--micro_batches", type=int, default=1, help="micro-batches per rank")
    ap.add_argument("--reshard_after_forward", action="store_true",
                    help="ZeRO-3 style (gather layers again in backward); default keeps them (ZeRO-2)")
    ap.add_argument("--steps", type=int, default=3, help="timed update_actor calls per run")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds of 1-rank and 2-rank runs")
    ap.add_argument("--skip_cpu", action="store_true")
    ap.add_argument("--gpu", action="store_true", help="run the GPU MFU part (default: when CUDA exists)")
    ap.add_argument("--gpu_rows", type=int, default=32)
    ap.add_argument("--gpu_seq", type=int, default=1024)
    ap.add_argument("--gpu_micro_batches", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = {}
    if not args.skip_cpu:
        result.update(cpu_scaling(args))
    if torch.cuda.is_available() or args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu given but CUDA is not available")
        result.update(gpu_mfu(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
