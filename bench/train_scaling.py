"""Training throughput of `update_actor`: 1 vs 2 CPU ranks, parallel layouts on 2 ranks, long-sequence
memory at sp=1/2, and actor MFU on GPUs.

    python bench/train_scaling.py                       # CPU: 1 rank, dp2, tp2, sp2; 8k-token memory; GPU MFU if CUDA
    python bench/train_scaling.py --layouts dp2,tp2 --rounds 3 --long_seq 0
    python bench/train_scaling.py --hidden 64 --layers 2 --rows 8 --seq 64 --steps 1 --rounds 1 \
        --long_seq 1024 --long_cap_mib 12 --gpu_dry     # a quick check that every part runs (CPU)
    python bench/train_scaling.py --skip_cpu --long_seq 0 --gpu    # only the GPU MFU part

CPU part: a random Qwen2 (hidden 256, 4 layers, 4 heads, 2 kv heads by default, so matmuls dominate
over the per-layer collectives) is trained with the real ActorRolloutRefWorker (FSDP2 over gloo, PPO
loss, AdamW, grad clipping) on one fixed global batch (the same rows, model and mini-batch in every
run: equal work). Runs alternate (1 rank, dp2, tp2, sp2, 1 rank, ...) in fresh process groups, 1
thread per rank; each run times `steps` calls of update_actor after a warm-up. Layouts on 2 ranks:

- dp2: FSDP2 over both ranks, each trains on half the rows (the 2-rank side of the 1-vs-2 scaling);
- tp2: tensor_model_parallel_size=2, both ranks train on all rows with half of every layer;
- sp2: ulysses_sequence_parallel_size=2, both ranks train on all rows, each on half the sequence.

tokens/s counts the real (unpadded) prompt+response tokens of the global batch per second;
scaling_2_ranks = median tokens/s of dp2 / of 1 rank (ideal 2.0). On a machine shared with other
jobs the wall clock also measures how often the scheduler runs both ranks at once, so the CPU
seconds of the busiest rank per step are reported too (work_scaling_2_ranks = CPU s of 1 rank / CPU
s of the busiest dp2 rank; `<layout>_over_dp2_cpu_s` the same for a layout against dp2). Defaults:
one micro-batch per data-parallel rank and ZeRO-2 style sharding (layers stay gathered until
backward), which halves the FSDP collectives per step.

Communication cost: one extra, untimed update_actor per run is traced by `CollectiveCounter`, a
TorchDispatchMode that sees every c10d and functional collective a rank issues (FSDP2's all-gathers
and reduce-scatters, DTensor's tensor-parallel all-reduces / all-gathers, Ulysses' all-to-alls, the
loss-scaling and grad-norm all-reduces). Per layout: collectives per step and their size in MiB, by
op, on rank 0 (every layout here is symmetric). A collective's size is its largest buffer (the full
all-gather output, the full reduce-scatter input: nccl-tests' convention); on a ring each rank then
sends (ranks - 1) / ranks of it.

Long-sequence memory (`--long_seq`, 8192 tokens by default; 0 skips it): bench/long_context.py's
measurement (live tensor bytes of one forward + backward of the tiny model at sp=1 vs sp=2 per rank,
with the cap `--long_cap_mib`: whether sp=1 exceeds it and sp=2 fits).

GPU part (when CUDA is available, or --gpu): update_actor of a Qwen2.5-0.5B-shaped random model
(hidden 896, 24 layers, 14 heads, 2 kv heads, vocab 151936) in bf16 compute (fp32 master weights) at
tp=1 on one GPU and tp=2 on two (when >= 2 are visible; else the JSON says so); MFU = achieved model
FLOPs (6 x matmul params x tokens + causal attention + lm_head) / (GPUs x the device's peak dense
bf16 FLOPs). `--gpu_dry` runs the same code path with a tiny shape (hidden 64, 2 layers, vocab 512)
and batch (8 rows x 128 tokens) on whatever device there is (CPU: tp=1 and tp=2 over 2 gloo ranks,
no MFU), so it does not rot on CPU-only machines.

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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `bench` as a package

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}
LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "sp2": (1, 2)}  # name -> (tensor_model_parallel_size, sp size) on 2 ranks
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # ops of those namespaces that move no data


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives this rank issues inside the mode: `ops[name] = [calls, bytes]`.

    Sees c10d ops (what torch.distributed's collectives and FSDP2 call) and functional collectives
    (what DTensor calls). A collective's bytes are those of its largest tensor argument or output.
    On one CPU host FSDP2's all-gathers and reduce-scatters go through a shared-memory segment
    (tinyzero.distributed.shm_comm), not c10d: they are counted under the c10d ops they stand in for.
    """

    SHM_OPS = {"all_gather_into": "_allgather_base_", "reduce_scatter_into": "_reduce_scatter_base_"}

    def __init__(self):
        super().__init__()
        self.ops: dict[str, list[int]] = {}
        self._shm_saved: dict = {}

    def _count(self, name: str, tensors) -> None:
        entry = self.ops.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += max((t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)), default=0)

    def __enter__(self):
        from tinyzero.distributed.shm_comm import ShmComm

        for method, name in self.SHM_OPS.items():
            original = self._shm_saved[method] = getattr(ShmComm, method)

            def counted(comm, output, input, *args, _original=original, _name=name, **kwargs):
                self._count(_name, (output, input))
                return _original(comm, output, input, *args, **kwargs)

            setattr(ShmComm, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        from tinyzero.distributed.shm_comm import ShmComm

        for method, original in self._shm_saved.items():
            setattr(ShmComm, method, original)
        self._shm_saved = {}
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # Modes run before tensor subclasses: step aside so DTensor desugars into plain ops and
            # collectives, which then come back through this mode (torch's CommDebugMode does the same).
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.namespace in COLLECTIVE_NAMESPACES and func._opname not in NOT_COLLECTIVES:
            self._count(func._opname, tree_leaves((args, kwargs, out)))
        return out

    def summary(self) -> dict:
        mib = 2.0**20
        return {"collectives_per_step": sum(c for c, _ in self.ops.values()),
                "mib_per_step": round(sum(b for _, b in self.ops.values()) / mib, 3),
                "by_op": {name: {"calls": c, "bytes": b, "mib": round(b / mib, 3)}
                          for name, (c, b) in sorted(self.ops.items())}}


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


def actor_config(model_dir: str, rows: int, micro: int, seq: int, grad_ckpt: bool, reshard: bool,
                 tp: int = 1, sp: int = 1):
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.workers.config import ActorConfig, ActorRolloutRefConfig, OptimConfig

    actor = ActorConfig(ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=micro, grad_clip=1.0,
                        optim=OptimConfig(lr=1e-6), fsdp_config=FSDPConfig(reshard_after_forward=reshard),
                        tensor_model_parallel_size=tp, ulysses_sequence_parallel_size=sp)
    return ActorRolloutRefConfig(model=ModelConfig(path=model_dir, enable_gradient_checkpointing=grad_ckpt),
                                 actor=actor, rollout=RolloutConfig(n=1, prompt_length=seq // 4,
                                                                    response_length=seq - seq // 4))


def timed_updates(model_dir: str, args, device_kind: str, tp: int = 1, sp: int = 1) -> dict:
    """In an initialised process group: build the actor with the layout (tp, sp), warm up, time `steps`
    updates (rank-0 clock), then count the collectives of one more update."""
    import torch.distributed as dist

    from tinyzero.distributed.parallel_dims import ParallelDims
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker

    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims.for_role(world, tp=tp, sp=sp)
    micro = max(1, args.rows // dims.dp_size // args.micro_batches)
    cfg = actor_config(model_dir, args.rows, micro, args.seq, grad_ckpt=False, reshard=args.reshard_after_forward,
                       tp=tp, sp=sp)
    worker = ActorRolloutRefWorker(cfg, "actor")
    worker.init_model()
    vocab = worker.actor.model.config.vocab_size
    batch, tokens = make_batch(args.rows, args.seq // 4, args.seq - args.seq // 4, vocab)
    # What DP_COMPUTE_PROTO dispatch would hand this rank: tp and sp peers share a chunk.
    local = batch.chunk(dims.dp_size)[dims.dp_rank(rank)] if dims.dp_size > 1 else batch
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
    with CollectiveCounter() as comm:  # untimed: the mode sees every op and slows the step
        worker.update_actor(local)
    step_s = statistics.median(times)
    # CPU seconds this rank spent per step: on a shared machine it shows the work each rank does,
    # whatever share of the cores the scheduler gave it.
    cpu = torch.tensor([statistics.median(cpu_times)], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    return {"world_size": world, "tp": tp, "sp": sp, "step_s": step_s, "tokens": tokens,
            "tokens_per_s": tokens / step_s, "max_rank_cpu_s_per_step": float(cpu), "comm": comm.summary(),
            "num_params": sum(p.numel() for p in worker.actor.model.parameters())}


def _rank_entry(rank: int, world: int, port: int, model_dir: str, args, out_file: str, tp: int, sp: int,
                device_kind: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_kind == "cpu":
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    from tinyzero.distributed import cleanup, init_distributed

    init_distributed()
    try:
        res = timed_updates(model_dir, args, device_kind, tp=tp, sp=sp)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(res, f)
    finally:
        cleanup()


def spawn_run(world: int, model_dir: str, args, tp: int = 1, sp: int = 1, device_kind: str = "cpu") -> dict:
    """One fresh group of `world` ranks with the layout (tp, sp); returns rank 0's timing."""
    import torch.multiprocessing as mp

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_file = f.name
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device_kind == "cpu":  # the ranks inherit it: a CPU run stays on CPU on a GPU machine too
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        ctx = mp.start_processes(_rank_entry, args=(world, _free_port(), model_dir, args, out_file, tp, sp,
                                                    device_kind), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + args.run_timeout_s
        while not ctx.join(timeout=5):  # a failed rank raises here with its traceback
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks {alive} of a {world}-rank run (tp={tp}, sp={sp}) did not finish in "
                                   f"--run_timeout_s={args.run_timeout_s}")
    finally:
        if hidden is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    with open(out_file) as f:
        res = json.load(f)
    os.unlink(out_file)
    return res


def parse_layouts(text: str) -> list[str]:
    """`--layouts` as a list; dp2 (the reference of every ratio) is always run."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        raise SystemExit(f"--layouts: unknown {bad}; choose from {','.join(LAYOUTS)}")
    return ["dp2"] + [n for n in dict.fromkeys(names) if n != "dp2"]


def cpu_scaling(args) -> dict:
    from tinyzero.models.tiny import build_tiny_model

    model_dir = tempfile.mkdtemp(prefix="train_scaling_")
    build_tiny_model(model_dir, seed=0, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                     num_kv_heads=2, intermediate_size=4 * args.hidden, max_position_embeddings=max(args.seq, 2048))
    layouts = parse_layouts(args.layouts)
    runs: dict[str, list[dict]] = {name: [] for name in ["1_rank"] + layouts}
    for _ in range(args.rounds):  # A B C A B C: every side sees the same background load on a shared machine
        runs["1_rank"].append(spawn_run(1, model_dir, args))
        for name in layouts:
            runs[name].append(spawn_run(2, model_dir, args, *LAYOUTS[name]))
        print(json.dumps({name: {k: r[-1][k] for k in ("tokens_per_s", "max_rank_cpu_s_per_step")}
                          for name, r in runs.items()}), file=sys.stderr)
    tps = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    cpu = {name: statistics.median(r["max_rank_cpu_s_per_step"] for r in rs) for name, rs in runs.items()}
    out = {"cpu_model": f"qwen2 hidden={args.hidden} layers={args.layers} heads=4 kv_heads=2",
           "num_params": runs["1_rank"][0]["num_params"], "rows": args.rows, "seq": args.seq,
           "tokens_per_s_1_rank": round(tps["1_rank"], 1), "tokens_per_s_2_ranks": round(tps["dp2"], 1),
           "scaling_2_ranks": round(tps["dp2"] / tps["1_rank"], 3),
           # CPU time of the busiest rank: 1-rank / 2-rank is the scaling idle cores would give
           # (it excludes time a rank spends descheduled on a loaded machine).
           "cpu_s_per_step_1_rank": round(cpu["1_rank"], 3), "cpu_s_per_step_2_ranks": round(cpu["dp2"], 3),
           "work_scaling_2_ranks": round(cpu["1_rank"] / cpu["dp2"], 3)}
    out["layouts"] = {name: {"tensor_model_parallel_size": LAYOUTS[name][0], "ulysses_sequence_parallel_size":
                             LAYOUTS[name][1], "tokens_per_s": round(tps[name], 1),
                             "cpu_s_per_step_busiest_rank": round(cpu[name], 3), "comm_rank0": runs[name][0]["comm"]}
                      for name in layouts}
    out["layouts"]["1_rank"] = {"tokens_per_s": round(tps["1_rank"], 1), "cpu_s_per_step": round(cpu["1_rank"], 3),
                                "comm_rank0": runs["1_rank"][0]["comm"]}
    for name in layouts[1:]:
        out[f"{name}_over_dp2_tokens_per_s"] = round(tps[name] / tps["dp2"], 3)
        out[f"{name}_over_dp2_cpu_s"] = round(cpu[name] / cpu["dp2"], 3)
    out.update(load_avg_1min=round(os.getloadavg()[0], 2), rounds=args.rounds)
    return out


def model_flops_per_token(cfg, seq: int) -> float:
    """Training FLOPs per token by the model's family (tinyzero.models.families), as perf/mfu/actor counts them."""
    from tinyzero.models.families import family_of

    return family_of(cfg).flops_per_token(cfg, seq)


def mfu_model_config(dry: bool):
    """Qwen2.5-0.5B's shape, or (dry) a tiny one with the same head layout ratios."""
    from transformers import Qwen2Config

    if dry:
        return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                           tie_word_embeddings=True, rope_theta=1e6)
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True, rope_theta=1e6)


def gpu_mfu(args) -> dict:
    """update_actor MFU of a Qwen2.5-0.5B-shaped random model at tp=1 and tp=2 (bf16 compute, fp32 master)."""
    from transformers import Qwen2ForCausalLM

    from tinyzero.models.loading import load_tokenizer
    from tinyzero.models.tiny import build_tiny_model

    cuda = torch.cuda.is_available()
    kind, gpus = ("cuda", torch.cuda.device_count()) if cuda else ("cpu", 0)
    model_dir = tempfile.mkdtemp(prefix="train_mfu_")
    # The offline byte-level tokenizer (token ids of the batch are random over the full vocab anyway).
    load_tokenizer(build_tiny_model(tempfile.mkdtemp(prefix="train_mfu_tok_"))).save_pretrained(model_dir)
    cfg = mfu_model_config(args.gpu_dry)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)
    rows, seq, micro = (8, 128, 1) if args.gpu_dry else (args.gpu_rows, args.gpu_seq, args.gpu_micro_batches)
    gargs = argparse.Namespace(**{**vars(args), "rows": rows, "seq": seq, "micro_batches": micro})
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    out = {"gpu": name, "gpu_count": gpus, "gpu_dry": args.gpu_dry,
           "gpu_model": f"qwen2 hidden={cfg.hidden_size} layers={cfg.num_hidden_layers} vocab={cfg.vocab_size}",
           "gpu_rows": rows, "gpu_seq": seq, "gpu_peak_tflops": peak}
    for tp in (1, 2):
        key = "gpu" if tp == 1 else "gpu_tp2"
        if cuda and gpus < tp:
            out[f"{key}_skipped"] = f"tp={tp} needs {tp} GPUs; {gpus} visible"
            continue
        res = spawn_run(tp, model_dir, gargs, tp=tp, device_kind=kind)
        # Padded positions are computed too, but MFU counts only real tokens (the useful work).
        achieved = res["tokens_per_s"] * model_flops_per_token(cfg, seq) / 1e12
        out.update({f"{key}_tokens_per_s": round(res["tokens_per_s"], 1), f"{key}_step_s": round(res["step_s"], 3),
                    f"{key}_achieved_tflops": round(achieved, 3),
                    f"{key}_mfu": round(achieved / (tp * peak), 4) if peak and cuda else None,
                    f"{key}_comm_mib_per_step": res["comm"]["mib_per_step"]})
    return out


def long_sequence_memory(args) -> dict:
    """bench/long_context.py's sp=1 vs sp=2 peak memory of one long row of the tiny model."""
    from bench.long_context import sp_peak_memory

    return {f"long_{k}": v for k, v in sp_peak_memory(args.long_seq, args.long_cap_mib).items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32, help="global batch rows (one mini-batch)")
    ap.add_argument("--seq", type=int, default=256, help="prompt + response length")
    ap.add_argument("--micro_batches", type=int, default=1, help="micro-batches per data-parallel rank")
    ap.add_argument("--reshard_after_forward", action="store_true",
                    help="ZeRO-3 style (gather layers again in backward); default keeps them (ZeRO-2)")
    ap.add_argument("--steps", type=int, default=3, help="timed update_actor calls per run")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (1 rank, each layout) runs")
    ap.add_argument("--layouts", default="dp2,tp2,sp2", help=f"2-rank layouts to compare, from {','.join(LAYOUTS)}")
    ap.add_argument("--skip_cpu", action="store_true", help="skip the 1-rank and layout runs")
    ap.add_argument("--long_seq", type=int, default=8192, help="tokens of the sp=1/2 memory row; 0 skips it")
    ap.add_argument("--long_cap_mib", type=float, default=96.0, help="memory cap of the sp=1/2 verdict (MiB)")
    ap.add_argument("--gpu", action="store_true", help="run the GPU MFU part (default: when CUDA exists)")
    ap.add_argument("--gpu_dry", action="store_true",
                    help="run the MFU code path with a tiny model on any device (CPU: 2 gloo ranks for tp=2)")
    ap.add_argument("--gpu_rows", type=int, default=32, help="global batch rows of the MFU runs")
    ap.add_argument("--gpu_seq", type=int, default=1024, help="prompt + response length of the MFU runs")
    ap.add_argument("--gpu_micro_batches", type=int, default=4, help="micro-batches per rank of the MFU runs")
    ap.add_argument("--run_timeout_s", type=float, default=1800.0, help="bound on one process group's run")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu given but CUDA is not available (use --gpu_dry for the code path on CPU)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = {"bench": "train_scaling"}
    if not args.skip_cpu:
        result.update(cpu_scaling(args))
    if args.long_seq:
        result.update(long_sequence_memory(args))
    if torch.cuda.is_available() or args.gpu_dry:
        result.update(gpu_mfu(args))
    else:
        result["gpu"] = None  # no CUDA device: the MFU part did not run (--gpu_dry exercises it on CPU)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
