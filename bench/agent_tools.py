"""Tool use on a real model on CPU: SmolLM2-135M-Instruct on 2-3 digit multiplication, with and without the calculator.

    python bench/agent_tools.py --model-path ~/.cache/tinyzero/smollm2-135m-instruct-0.1.2-v1 \
        [--num-problems 16 --samples 4 --threads 2 --response-length 96] [--sft-steps 40 --sft-batch 8]

The native engine, alone (the model answers directly) and inside the agent loop (rollout.multi_turn with
the calculator; a system prompt shows the Hermes tool-call format and one worked example), on "What is
a * b?" (a 2-digit, b 3-digit). Scored by the arithmetic rule (the last <answer>N</answer> of the
model's text; tool results are not in a tag). Measures what a tools demo on this model would start
from: accuracy without tools, greedy and sampled accuracy with the calculator, tool calls and stop
reasons per sample, and seconds per rollout of the batch (the generation share of one GRPO step).
With --sft-steps K: a format-only SFT warm-up first (K AdamW steps on other problems' tool
conversations whose final answers are near misses, the tool's result + 1, as the CPU demo's warm-up
teaches the format and not the answers; SFTDataset's multi-turn loss mask), its seconds per step,
and the greedy tool run again on the warmed-up model. Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import numpy as np
import torch

SYSTEM_TOOLS = (
    "You can use a calculator. To use it, write exactly\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "EXPRESSION"}}</tool_call>\n'
    "and stop; the result comes back in a tool message. Then give the final answer as <answer>NUMBER</answer>.\n"
    "Example:\nuser: What is 21 * 305?\nassistant: "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "21 * 305"}}</tool_call>\n'
    "tool: 6405\nassistant: <answer>6405</answer>"
)
SYSTEM_DIRECT = "Answer with the number only, as <answer>NUMBER</answer>."


def problems(num: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(10, 99), rng.randint(100, 999)) for _ in range(num)]


def tool_call(a: int, b: int) -> str:
    """The call the system prompt's example shows and the warm-up teaches."""
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}</tool_call>'


def sft_warmup(model_path: str, tok, out_dir: str, steps: int, batch: int, lr: float, seed: int,
               exclude: set) -> dict:
    """Format-only SFT (see the module docstring) written to out_dir; returns its timing and last loss."""
    import os

    from transformers import AutoModelForCausalLM

    from tinyzero.data.config import DataConfig
    from tinyzero.data.preprocess.common import write_parquet
    from tinyzero.data.sft_dataset import SFTDataset

    rng = random.Random(seed + 1)
    rows = []
    while len(rows) < steps * batch:
        a, b = rng.randint(10, 99), rng.randint(100, 999)
        if (a, b) in exclude:
            continue
        rows.append({"messages": [{"role": "system", "content": SYSTEM_TOOLS},
                                  {"role": "user", "content": f"What is {a} * {b}?"},
                                  {"role": "assistant", "content": tool_call(a, b)},
                                  {"role": "tool", "content": str(a * b)},
                                  {"role": "assistant", "content": f"<answer>{a * b + 1}</answer>"}]})
    os.makedirs(out_dir, exist_ok=True)
    write_parquet(rows, os.path.join(out_dir, "sft.parquet"))
    data = SFTDataset([os.path.join(out_dir, "sft.parquet")], tok, DataConfig(messages_key="messages",
                                                                              max_length=1024))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    start, loss = time.perf_counter(), torch.tensor(float("nan"))
    for step in range(steps):
        items = [data[i] for i in range(step * batch, (step + 1) * batch)]
        width = max(int(x["attention_mask"].sum()) for x in items)
        ids, mask, loss_mask = (torch.stack([x[k][:width] for x in items])
                                for k in ("input_ids", "attention_mask", "loss_mask"))
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(loss_mask == 0, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - start
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return {"steps": steps, "batch": batch, "seconds_per_step": round(seconds / max(steps, 1), 2),
            "last_loss": round(float(loss.detach()), 4)}


def prompt_batch(tok, system: str, pairs, n: int, do_sample: bool, seed: int):
    """Left-padded chat prompts "What is a * b?" with `system`, as the dataloader makes them."""
    from tinyzero.data.rl_dataset import compute_position_ids, left_pad
    from tinyzero.protocol import DataProto

    ids = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                               {"role": "user", "content": f"What is {a} * {b}?"}],
                                              add_generation_prompt=True, tokenize=False), add_special_tokens=False)
           for a, b in pairs]
    width = max(map(len, ids))
    rows = [left_pad(x, width, tok.pad_token_id) for x in ids]
    mask = torch.stack([r[1] for r in rows])
    ends = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    return DataProto.from_dict({"input_ids": torch.stack([r[0] for r in rows]), "attention_mask": mask,
                                "position_ids": compute_position_ids(mask)},
                               meta_info={"pad_token_id": tok.pad_token_id, "eos_token_id": ends, "n": n,
                                          "do_sample": do_sample, "seed": seed}), width


def score(tok, out, pairs, n: int) -> dict:
    """Accuracy (arithmetic rule on the model's own tokens) and the agent fields, when present."""
    from tinyzero.agent.metrics import agent_metrics
    from tinyzero.rewards.arithmetic import compute_score

    b = out.batch
    right = []
    for i in range(len(out)):
        own = b["responses"][i][b["response_mask"][i].bool()]  # observations left out: the model's text only
        a, c = pairs[i // n]
        right.append(compute_score(tok.decode(own, skip_special_tokens=True), str(a * c)) == 1.0)
    result = {"accuracy": float(np.mean(right)), "model_tokens_per_sample": float(b["response_mask"].sum()) / len(out)}
    metrics = agent_metrics(out.non_tensor_batch)
    for key in ("agent/tool_calls/mean", "agent/turns/mean", "agent/tool_errors/total", "agent/stop_reason/eos",
                "agent/stop_reason/max_turns", "agent/stop_reason/budget"):
        if key in metrics:
            result[key] = metrics[key]
    return result


def run(engine, tok, system: str, pairs, n: int, do_sample: bool, seed: int) -> dict:
    batch, width = prompt_batch(tok, system, pairs, n, do_sample, seed)
    start = time.perf_counter()
    out = engine.generate_sequences(batch)
    seconds = time.perf_counter() - start
    result = {**score(tok, out, pairs, n), "seconds": round(seconds, 2), "rows": len(out), "prompt_tokens": width,
              "example": tok.decode(out.batch["responses"][0][out.batch["attention_mask"][0, width:].bool()])}
    print(json.dumps(result), file=sys.stderr, flush=True)  # each stage as it ends (a long run shows progress)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="an HF folder (tinyzero.models.from_gguf output)")
    p.add_argument("--num-problems", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="samples per problem in the sampled run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--response-length", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=0, help="format-only SFT warm-up steps (0: none)")
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--sft-lr", type=float, default=5e-5)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    from tinyzero.agent import build_agent_engine
    from tinyzero.rollout import RolloutConfig, build_rollout

    tok = AutoTokenizer.from_pretrained(a.model_path, padding_side="left")
    pairs = problems(a.num_problems, a.seed)
    common = dict(name="native", response_length=a.response_length, prompt_length=512, dtype="fp32",
                  max_num_seqs=64, seed=a.seed)
    result: dict = {"model": a.model_path, "problems": a.num_problems, "threads": a.threads}
    engine = build_rollout(RolloutConfig(**common), a.model_path, tok, device="cpu", load_weights=True)
    result["direct_greedy"] = run(engine, tok, SYSTEM_DIRECT, pairs, 1, False, a.seed)
    engine.shutdown()
    mt = {"enable": True, "tools": ["calculator"], "max_turns": 3, "num_tool_workers": 2}
    agent = build_agent_engine(RolloutConfig(**common, multi_turn=mt), a.model_path, tok, device="cpu",
                               load_weights=True)
    try:
        result["tools_greedy"] = run(agent, tok, SYSTEM_TOOLS, pairs, 1, False, a.seed)
        result["tools_sampled"] = run(agent, tok, SYSTEM_TOOLS, pairs, a.samples, True, a.seed)
    finally:
        agent.shutdown()
    if a.sft_steps:
        import tempfile

        with tempfile.TemporaryDirectory() as warm:
            result["sft"] = sft_warmup(a.model_path, tok, warm, a.sft_steps, a.sft_batch, a.sft_lr, a.seed,
                                       set(pairs))
            print(json.dumps(result["sft"]), file=sys.stderr, flush=True)
            agent = build_rollout(RolloutConfig(**common, multi_turn=mt), warm, tok, device="cpu", load_weights=True)
            try:
                result["tools_greedy_after_sft"] = run(agent, tok, SYSTEM_TOOLS, pairs, 1, False, a.seed)
            finally:
                agent.shutdown()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
