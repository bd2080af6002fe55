"""Benchmarks of tinyzero.kernels: log-probs from hidden states, GAE, the Triton kernels.

    python bench/kernels.py                 # CPU figures (+ GPU figures when CUDA is present)
    python bench/kernels.py --quick         # small shapes, a smoke run of the script itself
    python bench/kernels.py --gpu-dry-run   # the GPU section on CPU, Triton interpreter, tiny shapes

CPU (torch paths), measured side by side A B A B with medians:
  logprob_peak_mem_ratio  peak extra memory of linear_log_probs / naive
                          log_softmax(lm_head(h).float()).gather(...), tokens=1024, hidden=896,
                          vocab=151936 (Qwen2.5-0.5B). Peak memory is the RSS high-water mark of a
                          fresh subprocess per variant, minus its RSS after setup (target <= 0.25).
  logprob_time_ratio      forward time ours / naive (target <= 1.5). Times are process CPU time (the
                          wall clock on a shared machine mostly measures the neighbours);
                          wall-clock ratios are reported beside them.
  gae_speedup             veRL's Python loop over time steps / the vectorised GAE, batch 256 x 1024
                          (target >= 20).
GPU (only with CUDA; otherwise "gpu": {"skipped": reason}):
  logprob_bw_fraction     Triton log-prob kernel bandwidth / measured copy bandwidth, tokens=16384,
                          vocab=151936, bf16 (target >= 0.7); also its speed-up over the naive path.
  gae_speedup_gpu         Python loop / Triton GAE at 1024 x 4096 (target >= 100).
  linear_peak_mem_ratio   linear_log_probs forward+backward peak / naive forward+backward peak.
  every Triton result is checked against the torch path first (relative error reported).
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
import time

import torch
from tinyzero.kernels import gae_advantage_return, linear_log_probs


# ----------------------------------------------------------------------------- helpers
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _logprob_inputs(tokens: int, hidden: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.empty(vocab, hidden).normal_(0.0, 0.02, generator=g)  # filled in place: no setup spike
    h = torch.randn(tokens, hidden, generator=g)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    return h, weight, labels


def naive_log_probs(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = torch.nn.functional.linear(h, weight).float()  # (tokens, vocab)
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def ours_log_probs(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return linear_log_probs(h, weight, labels, backend="torch")


VARIANTS = {"naive": naive_log_probs, "ours": ours_log_probs}


def _memory_child(variant: str, tokens: int, hidden: int, vocab: int) -> None:
    """Run one variant once in this (fresh) process and print its peak extra RSS."""
    torch.set_num_threads(1)
    h, weight, labels = _logprob_inputs(tokens, hidden, vocab)
    with torch.no_grad():
        VARIANTS[variant](h[:8], weight, labels[:8])  # warm allocator / kernels on a tiny slice
    base = max(_rss_bytes(), _peak_rss_bytes())
    with torch.no_grad():
        out = VARIANTS[variant](h, weight, labels)
    peak = _peak_rss_bytes()
    assert torch.isfinite(out).all()
    print(json.dumps({"extra_bytes": max(peak - base, 0)}))


def _measure_memory(variant: str, args) -> int:
    cmd = [sys.executable, __file__, "--memory-child", variant, "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]


def _interleaved(fns: dict, rounds: int, sync=lambda: None, clock=time.perf_counter) -> dict[str, float]:
    """Median time of each fn by `clock`, run A B A B ... for `rounds` rounds after one warm-up each."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    sync()
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = clock()
            fn()
            sync()
            times[name].append(clock() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _interleaved_cpu(fns: dict, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """(median process CPU time, median wall time) per fn, interleaved A B A B.

    On a shared machine the wall clock also counts time spent waiting for a core; the CPU
    time of this process is the work the variant itself did, so the ratios use it.
    """
    both = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            both[name].append((time.process_time() - c0, time.perf_counter() - w0))
    cpu = {n: statistics.median(t[0] for t in ts) for n, ts in both.items()}
    wall = {n: statistics.median(t[1] for t in ts) for n, ts in both.items()}
    return cpu, wall


def gae_python_loop(rewards, values, mask, gamma, lam):
    """veRL's compute_gae_advantage_return loop (un-whitened advantages)."""
    next_values, last = 0, 0
    out = []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_ = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = last_ * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    return torch.stack(out[::-1], dim=1)


def _gae_inputs(batch: int, length: int, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    rewards = torch.randn(batch, length, generator=g) * mask
    values = torch.randn(batch, length, generator=g)
    return rewards.to(device), values.to(device), mask.to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()).clamp_min(1e-30))


# ----------------------------------------------------------------------------- CPU
def bench_cpu(args) -> dict:
    torch.set_num_threads(args.threads)
    result: dict = {}
    mem = {"naive": [], "ours": []}
    for _ in range(args.mem_rounds):  # A B A B, fresh process each
        for variant in ("naive", "ours"):
            mem[variant].append(_measure_memory(variant, args))
    mem_naive, mem_ours = statistics.median(mem["naive"]), statistics.median(mem["ours"])
    h, weight, labels = _logprob_inputs(args.tokens, args.hidden, args.vocab)
    with torch.no_grad():
        err = _rel(ours_log_probs(h, weight, labels), naive_log_probs(h.double(), weight.double(), labels))
        times, wall = _interleaved_cpu({name: (lambda f=f: f(h, weight, labels)) for name, f in VARIANTS.items()},
                                       args.rounds)
    result.update({
        "logprob_peak_mem_ratio": mem_ours / max(mem_naive, 1),
        "logprob_time_ratio": times["ours"] / times["naive"],
        "logprob_naive_extra_mib": mem_naive / 2**20,
        "logprob_ours_extra_mib": mem_ours / 2**20,
        "logprob_naive_cpu_s": times["naive"],
        "logprob_ours_cpu_s": times["ours"],
        "logprob_time_ratio_wall": wall["ours"] / wall["naive"],
        "logprob_rel_err_vs_fp64": err,
        "logprob_shape": [args.tokens, args.hidden, args.vocab],
    })
    r, v, m = _gae_inputs(args.gae_batch, args.gae_len)
    ours_adv, _ = gae_advantage_return(r, v, m, 0.99, 0.95, backend="torch")
    loop_adv = gae_python_loop(r.double(), v.double(), m.double(), 0.99, 0.95)
    gae_times, gae_wall = _interleaved_cpu({
        "loop": lambda: gae_python_loop(r, v, m, 0.99, 0.95),
        "ours": lambda: gae_advantage_return(r, v, m, 0.99, 0.95, backend="torch")}, args.gae_rounds)
    result.update({
        "gae_speedup": gae_times["loop"] / gae_times["ours"],
        "gae_speedup_wall": gae_wall["loop"] / gae_wall["ours"],
        "gae_loop_cpu_ms": gae_times["loop"] * 1e3,
        "gae_ours_cpu_ms": gae_times["ours"] * 1e3,
        "gae_rel_err_vs_fp64_loop": _rel(ours_adv, loop_adv),
        "gae_shape": [args.gae_batch, args.gae_len],
        "cpu_threads": args.threads,
        "timing_clock": "median process CPU time, A B A B interleaved (wall-clock ratios beside)",
        "load_average_1min": os.getloadavg()[0],
    })
    return result


# ----------------------------------------------------------------------------- GPU
def bench_gpu(args, dev: torch.device) -> dict:
    """GPU figures on `dev` (CUDA). With --gpu-dry-run, dev is the CPU and the Triton kernels run in
    the interpreter at tiny shapes: the numbers mean nothing, but every code path executes."""
    from tinyzero.kernels import log_probs_from_logits

    on_cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    out: dict = {"device": torch.cuda.get_device_name(dev) if on_cuda else "cpu (dry run, Triton interpreter)"}
    tokens, vocab, hidden = args.gpu_tokens, args.vocab, args.hidden
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(tokens, vocab, device=dev, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
    # correctness first: Triton vs torch path vs float64 on a slice
    lp_t, ent_t = log_probs_from_logits(logits[:256], labels[:256], return_entropy=True, backend="triton")
    lp_r, ent_r = log_probs_from_logits(logits[:256].double(), labels[:256], return_entropy=True, backend="torch")
    out["logprob_rel_err"] = _rel(lp_t, lp_r)
    out["entropy_rel_err"] = _rel(ent_t, ent_r)
    copy_dst = torch.empty_like(logits)

    def naive():
        return torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None])

    times = _interleaved({
        "copy": lambda: copy_dst.copy_(logits),
        "triton": lambda: log_probs_from_logits(logits, labels, backend="triton"),
        "triton_entropy": lambda: log_probs_from_logits(logits, labels, return_entropy=True, backend="triton"),
        "naive": naive,
    }, args.rounds, sync)
    nbytes = logits.numel() * logits.element_size()
    copy_bw = 2 * nbytes / times["copy"]  # read + write
    out.update({
        "copy_bw_gbs": copy_bw / 1e9,
        "logprob_bw_fraction": (nbytes / times["triton"]) / copy_bw,
        "logprob_entropy_bw_fraction": (nbytes / times["triton_entropy"]) / copy_bw,
        "logprob_speedup_vs_naive": times["naive"] / times["triton"],
        "logprob_triton_ms": times["triton"] * 1e3,
    })
    torch.cuda.empty_cache()

    if on_cuda:
        torch.cuda.empty_cache()
    r, v, m = _gae_inputs(args.gpu_gae_batch, args.gpu_gae_len, device=dev)
    adv_t, _ = gae_advantage_return(r, v, m, 0.99, 0.95, backend="triton")
    adv_ref = gae_python_loop(r.double(), v.double(), m.double(), 0.99, 0.95)
    out["gae_rel_err"] = _rel(adv_t, adv_ref)
    gt = _interleaved({"loop": lambda: gae_python_loop(r, v, m, 0.99, 0.95),
                       "triton": lambda: gae_advantage_return(r, v, m, 0.99, 0.95, backend="triton")},
                      max(3, args.rounds // 2), sync)
    out.update({"gae_speedup_gpu": gt["loop"] / gt["triton"], "gae_triton_ms": gt["triton"] * 1e3})

    weight = (torch.randn(vocab, hidden, device=dev, generator=g) * 0.02).to(torch.bfloat16).requires_grad_(True)
    h = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16).requires_grad_(True)

    def naive_fb():
        logp = torch.log_softmax(torch.nn.functional.linear(h, weight).float(), -1).gather(-1, labels[:, None])
        logp.sum().backward()

    def ours_fb():
        linear_log_probs(h, weight, labels, backend="triton").sum().backward()

    peaks = {}
    for name, fn in (("naive", naive_fb), ("ours", ours_fb)):
        fn()  # warm-up (allocates .grad)
        sync()
        if not on_cuda:
            continue  # no allocator statistics on the dry run
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        sync()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    ft = _interleaved({"naive": naive_fb, "ours": ours_fb}, max(3, args.rounds // 2), sync)
    has_mem = on_cuda
    out.update({
        "linear_peak_mem_ratio": peaks["ours"] / max(peaks["naive"], 1) if has_mem else None,
        "linear_naive_peak_mib": peaks["naive"] / 2**20 if has_mem else None,
        "linear_ours_peak_mib": peaks["ours"] / 2**20 if has_mem else None,
        "linear_fwd_bwd_time_ratio": ft["ours"] / ft["naive"],
    })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mem-rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (keep shared machines usable)")
    p.add_argument("--gae-batch", type=int, default=256)
    p.add_argument("--gae-len", type=int, default=1024)
    p.add_argument("--gae-rounds", type=int, default=15)
    p.add_argument("--gpu-tokens", type=int, default=16384)
    p.add_argument("--gpu-gae-batch", type=int, default=1024)
    p.add_argument("--gpu-gae-len", type=int, default=4096)
    p.add_argument("--gpu-dry-run", action="store_true",
                   help="run the GPU section on the CPU under the Triton interpreter at tiny shapes (no CPU section)")
    p.add_argument("--skip-gpu", action="store_true")
    p.add_argument("--quick", action="store_true", help="small shapes: check that the script runs")
    p.add_argument("--memory-child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child:
        _memory_child(args.memory_child, args.tokens, args.hidden, args.vocab)
        return
    if args.gpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (tinyzero.kernels imports it lazily)
        args.gpu_tokens, args.vocab, args.hidden, args.rounds = 24, 700, 16, 1
        args.gpu_gae_batch, args.gpu_gae_len = 4, 300
        print(json.dumps({"gpu": bench_gpu(args, torch.device("cpu"))}))
        return
    if args.quick:
        args.tokens, args.hidden, args.vocab, args.rounds, args.mem_rounds = 64, 32, 5000, 1, 1
        args.gae_batch, args.gae_len, args.gae_rounds, args.gpu_tokens = 16, 64, 1, 256
    result = {"cpu": bench_cpu(args)}
    result.update({k: result["cpu"][k] for k in ("logprob_peak_mem_ratio", "logprob_time_ratio", "gae_speedup")})
    if args.skip_gpu or not torch.cuda.is_available():
        result["gpu"] = {"skipped": "--skip-gpu given" if args.skip_gpu else "no CUDA device on this machine"}
    else:
        result["gpu"] = bench_gpu(args, torch.device("cuda"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
