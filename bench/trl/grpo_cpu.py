"""TRL's GRPOTrainer timed on CPU on the workload of bench/vs_trl.py (the TRL side of that bench).

    OMP_NUM_THREADS=1 /tmp/trlenv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/trl/grpo_cpu.py --threads 1 --model MODEL_DIR [--steps 5 --warmup 1 --json-out r.json]

Runs under TRL's own virtual environment (bench/trl/README.md); TRL is never a tinyzero dependency.
Only the standard library is imported at module level, so `make_prompts` can be read by tinyzero's
side without TRL.

Work per optimizer step: `--prompts-per-step` prompts (8) x `--num-generations` samples (4), at most
`--max-completion-length` (64) new tokens, stop at eos, temperature 1, top_p 1, top_k off; the reward
`answer_tag_reward`; GRPO with group-normalised advantages, token-mean loss (`loss_type="dapo"`),
clip 0.2, `--beta` 0 (no reference model); one AdamW step per generation batch (lr 1e-5 constant,
weight decay 0, betas 0.9 / 0.999, grad clip 1), fp32, activation checkpointing off.

Measured (after `--warmup` unmeasured steps): the wall time of each optimizer step (a TrainerCallback
at step end), the time spent in the model's `generate` during it (slowest rank), the completion tokens
it generated (up to and including eos, all ranks), the peak RSS of the largest rank, and the foreign
CPU share of the measured window (busy CPU time of the machine not spent by the ranks, over wall x
CPUs: above ~0.03 the run shared its cores). Rank 0's last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time


def make_prompts(n: int, seed: int) -> list[dict]:
    """`n` countdown-style chat prompts: three or four numbers in 1..99 and a target in 1..999 that
    they reach with + - * applied left to right (their sum when the chain leaves that range)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        nums = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        value = nums[0]
        for x in nums[1:]:
            value = {"+": value + x, "-": value - x, "*": value * x}[rng.choice("+-*")]
        target = value if 1 <= value <= 999 else sum(nums)
        text = f"Using the numbers {nums}, make {target}. Answer in <answer></answer>"
        rows.append({"prompt": [{"role": "user", "content": text}], "nums": nums, "target": target})
    return rows


def answer_tag_score(text: str) -> float:
    """1.0 for an <answer> tag, plus 0.1 x the share of digits in the text (keeps a random model's
    group advantages from being all zero)."""
    return (1.0 if "<answer>" in text else 0.0) + 0.1 * sum(c.isdigit() for c in text) / max(1, len(text))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF model folder with a chat template")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 loads a reference model")
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured optimizer steps before them")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default $OMP_NUM_THREADS or 1)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--max-prompt-length", type=int, default=128,
                   help="longest rendered prompt accepted (TRL does not truncate prompts; checked up front)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="TRL's output_dir (default: a temporary folder)")
    p.add_argument("--json-out", default=None, help="also write the result line to this file (rank 0)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the first step warms up)")
    return args


def busy_cpu_s() -> float:
    """Whole-machine busy CPU seconds since boot (/proc/stat: user nice system irq softirq)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    args = parse_args()
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "1"))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before torch is imported
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import accelerate
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(threads)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    per_step = args.prompts_per_step * args.num_generations
    if per_step % world:
        sys.exit(f"--prompts-per-step x --num-generations = {per_step} completions do not split over "
                 f"{world} processes; pick a multiple of the process count")
    total = args.warmup + args.steps

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    if not tok.chat_template:
        sys.exit(f"--model {args.model}: the tokenizer has no chat template; pass a chat model folder")
    rows = make_prompts(max(256, total * args.prompts_per_step * 2), args.seed)
    lengths = [len(tok.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"]) for r in rows]
    if max(lengths) > args.max_prompt_length:
        sys.exit(f"a prompt renders to {max(lengths)} tokens > --max-prompt-length {args.max_prompt_length}; "
                 "raise it (on both sides of the comparison)")

    tokens: dict[int, int] = {}  # global_step during generation -> completion tokens (this rank)
    gen_s: dict[int, float] = {}  # global_step during generation -> seconds in generate (this rank)

    def answer_tag_reward(completions, completion_ids, trainer_state, **_):
        step = trainer_state.global_step  # optimizer steps finished before this generation
        tokens[step] = tokens.get(step, 0) + sum(len(ids) for ids in completion_ids)
        return [answer_tag_score(c[-1]["content"] if isinstance(c, list) else c) for c in completions]

    class StepClock(transformers.TrainerCallback):
        """perf_counter at the start of training and at the end of every optimizer step; at the ends
        of the warm-up and of the run, also the CPU time of this process and the machine's busy time."""

        def __init__(self):
            self.ends: dict[int, float] = {}
            self.marks: dict[int, tuple[float, float, float]] = {}

        def on_train_begin(self, *a, **k):
            self.ends[0] = time.perf_counter()

        def on_step_end(self, targs, state, control, **k):
            self.ends[state.global_step] = time.perf_counter()
            if state.global_step in (args.warmup, total):
                self.marks[state.global_step] = (time.perf_counter(), time.process_time(), busy_cpu_s())

    cfg = trl.GRPOConfig(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="trl-grpo-cpu-"),
        use_cpu=True, bf16=False, fp16=False, model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=per_step // world, gradient_accumulation_steps=1,
        num_generations=args.num_generations, num_iterations=1,
        max_completion_length=args.max_completion_length, temperature=1.0, top_p=1.0, top_k=0,
        loss_type="dapo", epsilon=0.2, beta=args.beta,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, activation_checkpointing=False,
        use_vllm=False, max_steps=total, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=args.seed, data_seed=args.seed, dataloader_num_workers=0,
        ddp_find_unused_parameters=False, log_completions=False,
    )
    if cfg.generation_batch_size != per_step:
        sys.exit(f"TRL made generation batches of {cfg.generation_batch_size} completions, not {per_step}")
    clock = StepClock()
    trainer = trl.GRPOTrainer(model=args.model, reward_funcs=answer_tag_reward, args=cfg,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tok,
                              callbacks=[clock])
    generate = trainer.model.generate  # the module TRL unwraps from DDP for generation

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            step = trainer.state.global_step
            gen_s[step] = gen_s.get(step, 0.0) + time.perf_counter() - t0

    trainer.model.generate = timed_generate
    trainer.train()

    local = {"tokens": tokens, "gen_s": gen_s, "marks": clock.marks,
             "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    ranks = [local]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks = [None] * world
        torch.distributed.all_gather_object(ranks, local)
        torch.distributed.barrier()  # no rank leaves while gloo still talks to it
        torch.distributed.destroy_process_group()
    if rank != 0:
        return
    measured = range(args.warmup + 1, total + 1)  # step s generates while global_step == s - 1
    step_s = [clock.ends[s] - clock.ends[s - 1] for s in measured]
    gen = [max(r["gen_s"].get(s - 1, 0.0) for r in ranks) for s in measured]
    if not all(gen):
        sys.exit("the model's generate was not called in a measured step: this TRL generates another way; "
                 "use the pinned versions of bench/trl/requirements.txt")
    toks = [sum(r["tokens"].get(s - 1, 0) for r in ranks) for s in measured]
    (t0, _, busy0), (t1, _, busy1) = ranks[0]["marks"][args.warmup], ranks[0]["marks"][total]
    own = sum(r["marks"][total][1] - r["marks"][args.warmup][1] for r in ranks)
    window = (t1 - t0) * (os.cpu_count() or 1)
    result = {
        "framework": "trl", "trl": trl.__version__, "transformers": transformers.__version__,
        "torch": torch.__version__, "accelerate": accelerate.__version__, "datasets": datasets.__version__,
        "world_size": world, "threads_per_process": threads, "beta": args.beta, "loss_type": cfg.loss_type,
        "activation_checkpointing": bool(getattr(trainer.model, "is_activation_checkpointing", False)),
        "prompts_per_step": args.prompts_per_step, "num_generations": args.num_generations,
        "max_completion_length": args.max_completion_length,
        "prompt_tokens_min_max": [min(lengths), max(lengths)],
        "warmup_steps": args.warmup, "measured_steps": args.steps,
        "sec_per_step_median": statistics.median(step_s),
        "gen_sec_per_step_median": statistics.median(gen),
        "gen_tokens_per_s": sum(toks) / sum(step_s),
        "tokens_per_step": toks,
        "peak_rss_mib": round(max(r["peak_rss_mib"] for r in ranks), 1),
        "foreign_cpu_frac": round(max(0.0, busy1 - busy0 - own) / window, 4),
        "step_s": [round(x, 4) for x in step_s],
        "gen_s": [round(x, 4) for x in gen],
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
