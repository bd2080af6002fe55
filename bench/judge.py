"""In-process judge: one batch on HF generate (reward.judge.engine=hf) vs the native engine (native).

    python -m tinyzero.models.from_gguf --out DIR     # SmolLM2-135M-Instruct (see tests/real_model.py)
    python bench/judge.py --model DIR [--batch-size 8 --max-new-tokens 48 --rounds 3 --threads 2]

Both judges get the same batch (the default template, a question, a reference and an answer per sample)
and run greedy in float32 on CPU (--dtype, --device to change). After one warm-up batch each, the two are
timed in turn (hf native hf native ...) --rounds times; medians of wall and process CPU seconds per batch
(CPU seconds move less when other work shares the machine). The replies of the two must be the same.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tinyzero.rewards.judge import HFJudgeBackend, Judge
from tinyzero.rewards.judge_config import JudgeConfig
from tinyzero.rewards.judge_engine import EngineJudgeBackend

SAMPLES = [
    ("What is 2 + 2?", "4", "4"), ("What is 2 + 2?", "It is 5.", "4"),
    ("What is the capital of France?", "Paris", "Paris"), ("What is the capital of France?", "Lyon", "Paris"),
    ("Name a primary colour.", "Blue.", None), ("How many legs does a spider have?", "Eight legs.", "8"),
    ("What is 12 * 3?", "12 * 3 = 36", "36"), ("Who wrote Hamlet?", "Charles Dickens wrote it.", "William Shakespeare"),
]


def timed(judge: Judge, prompts, responses, refs) -> tuple[float, float, list[str]]:
    wall, cpu = time.perf_counter(), time.process_time()
    results = judge.score(prompts, responses, refs)
    return time.perf_counter() - wall, time.process_time() - cpu, [r["extra"]["judge_output"] for r in results]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF causal LM folder with a chat template")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [SAMPLES[i % len(SAMPLES)] for i in range(args.batch_size)]
    prompts, responses, refs = (list(x) for x in zip(*rows))
    device = torch.device(args.device)
    judges = {}
    for engine in ("hf", "native"):
        cfg = JudgeConfig(enable=True, model_path=args.model, engine=engine, dtype=args.dtype,
                          batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
        backend = HFJudgeBackend(cfg, device) if engine == "hf" else EngineJudgeBackend(cfg, device)
        judges[engine] = Judge(cfg, backend=backend)
    replies = {e: timed(j, prompts, responses, refs)[2] for e, j in judges.items()}  # warm-up
    walls: dict[str, list[float]] = {e: [] for e in judges}
    cpus: dict[str, list[float]] = {e: [] for e in judges}
    for _ in range(args.rounds):
        for engine, judge in judges.items():
            wall, cpu, got = timed(judge, prompts, responses, refs)
            walls[engine].append(wall)
            cpus[engine].append(cpu)
            assert got == replies[engine], f"{engine}: replies changed between rounds"
    same = replies["hf"] == replies["native"]
    out = {"batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
           "dtype": args.dtype, "device": args.device, "replies_equal": same,
           "new_tokens": sum(len(judges["hf"].backend.tokenizer(r)["input_ids"]) for r in replies["hf"])}
    for engine in judges:
        out[f"{engine}_s"] = round(statistics.median(walls[engine]), 3)
        out[f"{engine}_cpu_s"] = round(statistics.median(cpus[engine]), 3)
    out["native_speedup"] = round(out["hf_s"] / out["native_s"], 2)
    out["native_cpu_speedup"] = round(out["hf_cpu_s"] / out["native_cpu_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
