"""tinyzero against TRL's GRPOTrainer on the same GRPO workload, side by side in one run.

    python bench/vs_trl.py --model tiny --trl-python /tmp/trlenv/bin/python
    python bench/vs_trl.py --model smollm2 --trl-python /tmp/trlenv/bin/python --rounds 2 --steps 3
    python bench/vs_trl.py --model DIR ...      # any HF folder with a chat template

TRL runs from its own virtual environment (`--trl-python`; TRL is never a tinyzero dependency)
through the harness `--trl-harness` (default bench/trl/grpo_cpu.py; bench/trl/README.md has the
environment recipe). tinyzero runs `train.py` under torchrun with the same model folder and the
same work per optimizer step:
  model     `tiny`: tinyzero's offline tiny Qwen2 (tinyzero.models.tiny, hidden 128, seed 0, ChatML
            chat template), written into the work folder; or SmolLM2-135M-Instruct, or a folder;
  prompts   the harness's own `make_prompts` (read from its source), one chat message each, rendered
            with the chat template; written to a parquet;
  sampling  8 prompts x 4 samples, <= 64 new tokens, stop at eos, temperature 1, top_p 1, top_k off;
  reward    1.0 if "<answer>" is in the response, + 0.1 x digits / characters (`answer_tag_reward`
            below, passed as reward.custom_fn);
  update    GRPO advantages (group mean / std), token-mean loss, clip 0.2, no KL, one AdamW step per
            batch (lr 1e-5 constant, wd 0, betas 0.9 / 0.999), grad clip 1, fp32, no activation
            checkpointing; 2 processes x 1 thread.
  settings  ours on a real model (not the tiny one): real_model_flags() below, the real_cpu preset's
            CPU settings (tensor-parallel rollout over both ranks, sleep level 2, fused layers,
            freed heap pages kept); --plain leaves them out;
  precision fp32 by default; --precision bf16 runs both sides in bf16 mixed precision (fp32 master
            weights and optimizer; TRL's bf16=True through bench/trl_bf16.py, ours FSDP2
            param_dtype=bf16 and a bf16 rollout engine).
  defaults  --defaults adds a third side: ours with the workload's settings alone, so the run plan
            chooses the speed settings as it does for a new user (tinyzero.plan.choose_fast_path).
Runs are interleaved (TRL, ours, TRL, ours, ...). Before each, the bench waits (bounded by
--idle-wait-s) until the machine's busy CPU share is below --idle-busy, and it records the foreign
CPU share during the run (busy CPU time not spent by the run's own processes, over wall x CPUs).
Per run: seconds per step (median over the measured steps, the first --warmup steps skipped),
generated tokens per step and per second, peak RSS of the largest process (a rank), per-phase
medians (ours: the timing_s/* metrics; TRL: generation and the rest). The last line is one JSON
object with step_time_ratio, tokens_per_s_ratio and peak_rss_ratio (ours / TRL; medians of the
per-round ratios) and both sides' medians.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_HARNESS = os.path.join(ROOT, "bench", "trl", "grpo_cpu.py")
DATA_SOURCE = "answer_tag"


def answer_tag_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The harness's reward: 1.0 for an <answer> tag, plus 0.1 x the share of digits in the text."""
    del data_source, ground_truth, extra_info
    score = 1.0 if "<answer>" in solution_str else 0.0
    return score + 0.1 * sum(ch.isdigit() for ch in solution_str) / max(1, len(solution_str))


# ---------------------------------------------------------------------------------------------- workload
def harness_make_prompts(harness: str):
    """The `make_prompts(n, seed)` function of the harness, taken from its source (the harness itself
    parses arguments and imports TRL at import time, so it cannot be imported here)."""
    with open(harness) as f:
        tree = ast.parse(f.read(), harness)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "make_prompts"]
    if not fns:
        raise ValueError(f"{harness} defines no make_prompts(n, seed); pass bench/trl/grpo_cpu.py")
    namespace: dict = {}
    module = ast.fix_missing_locations(ast.Module(body=[ast.Import(names=[ast.alias("random")]), *fns],
                                                  type_ignores=[]))
    exec(compile(module, harness, "exec"), namespace)
    return namespace["make_prompts"]


def write_prompts(harness: str, path: str, num_rows: int, seed: int) -> str:
    """The harness's prompts as a tinyzero RL parquet (the reward ignores ground_truth)."""
    from tinyzero.data.preprocess.common import write_parquet

    rows = [{"data_source": DATA_SOURCE, "prompt": r["prompt"], "ability": "bench",
             "reward_model": {"style": "rule", "ground_truth": str(r["target"])},
             "extra_info": {"split": "train", "index": i}}
            for i, r in enumerate(harness_make_prompts(harness)(num_rows, seed))]
    write_parquet(rows, path)
    return path


def prepare_model(name: str, work: str, smollm2_dir: str) -> str:
    """The model folder both sides load: tinyzero's offline tiny model, SmolLM2-135M-Instruct, or a path."""
    if name == "tiny":
        from tinyzero.models.tiny import build_tiny_model

        # hidden 128: about 0.33M parameters, the size of the tiny figures in bench/RESULTS.md
        return build_tiny_model(os.path.join(work, "tiny_model"), seed=0, hidden_size=128)
    if name == "smollm2":
        if not os.path.isfile(os.path.join(smollm2_dir, "model.safetensors")):
            from tinyzero.models.from_gguf import convert

            convert(smollm2_dir)
        return os.path.abspath(smollm2_dir)
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise ValueError(f"--model {name}: use tiny, smollm2 or an HF model folder (no config.json there)")
    return os.path.abspath(name)


# ---------------------------------------------------------------------------------------------- machine
def busy_cpu_s() -> float:
    """Whole-machine busy CPU seconds since boot (/proc/stat: user nice system irq softirq)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def wait_idle(max_busy: float, timeout_s: float, window_s: float = 3.0) -> dict:
    """Wait until the machine's busy share over `window_s` is below `max_busy` (at most timeout_s)."""
    start, ncpu = time.monotonic(), os.cpu_count() or 1
    while True:
        b0, t0 = busy_cpu_s(), time.monotonic()
        time.sleep(window_s)
        busy = (busy_cpu_s() - b0) / ((time.monotonic() - t0) * ncpu)
        waited = time.monotonic() - start
        if busy < max_busy or waited >= timeout_s:
            return {"idle_wait_s": round(waited, 1), "busy_before": round(busy, 3), "idle": busy < max_busy,
                    "load_avg_1m": round(os.getloadavg()[0], 2)}


def run_measured(cmd: list[str], env: dict, log_path: str, timeout_s: float) -> dict:
    """Run cmd; its wall time, peak RSS of its largest process, and the foreign CPU share meanwhile."""
    ncpu = os.cpu_count() or 1
    b0, t0 = busy_cpu_s(), time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = t0 + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.killpg(proc.pid, 9)
                _, status, usage = os.wait4(proc.pid, 0)
                raise RuntimeError(f"{cmd[:4]} ran past {timeout_s:.0f} s; log: {log_path}")
            time.sleep(0.2)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}; log {log_path}:\n{tail}")
    own = usage.ru_utime + usage.ru_stime
    foreign = max(0.0, busy_cpu_s() - b0 - own) / (wall * ncpu)
    return {"wall_s": round(wall, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "foreign_cpu_frac": round(foreign, 4)}


# ---------------------------------------------------------------------------------------------- the two sides
def run_trl(args, model: str, work: str, tag: str) -> dict:
    out_json = os.path.join(work, f"trl_{tag}.json")
    harness = [os.path.abspath(args.trl_harness)]
    if args.precision == "bf16":  # the same harness under TRL's bf16 mixed precision
        harness = [os.path.join(ROOT, "bench", "trl_bf16.py"), *harness]
    cmd = [args.trl_python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           *harness, "--threads", "1", "--beta", "0.0", "--model", model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
           "--output-dir", os.path.join(work, f"trl_out_{tag}"), "--json-out", out_json]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    m = run_measured(cmd, env, os.path.join(work, f"trl_{tag}.log"), args.run_timeout_s)
    with open(out_json) as f:
        r = json.load(f)
    tokens = statistics.median(r["tokens_per_step"])
    return {**m, "sec_per_step": r["sec_per_step_median"], "tokens_per_step": tokens,
            "tokens_per_s": r["gen_tokens_per_s"], "harness_peak_rss_mib": r["peak_rss_mib"],
            "harness_foreign_cpu_frac": r["foreign_cpu_frac"],
            "phases": {"gen": r["gen_sec_per_step_median"],
                       "rest": r["sec_per_step_median"] - r["gen_sec_per_step_median"]},
            "step_s": r["step_s"], "trl": r["trl"], "transformers": r["transformers"]}


def real_model_flags() -> list[str]:
    """Our side's settings for a model of real size on CPU, read from the real_cpu preset (--plain
    leaves them out; --ours-flag, given after them, overrides any): the rollout decodes tensor-parallel
    over both ranks, sleep level 2 frees the engine's weights and cache for the update, the fused
    layers keep less for backward, and the heaps keep freed pages for reuse (tinyzero.runtime.host_memory)."""
    from tinyzero.configs.real import real_cpu

    cfg = real_cpu()
    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    return [f"--actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size}",
            f"--actor_rollout_ref.rollout.sleep_level={rollout.sleep_level}",
            f"--actor_rollout_ref.model.use_fused_layers={str(model.use_fused_layers).lower()}",
            f"--tuning.host_keep_freed_memory={str(cfg.tuning.host_keep_freed_memory).lower()}"]


def run_ours(args, model: str, data: str, work: str, tag: str, defaults: bool = False) -> dict:
    """One run of train.py on the workload; `defaults`: the workload's settings alone (no packing flag,
    no real_model_flags, no --ours-flag), so the run plan picks the speed settings as for a new user."""
    from tinyzero.trainer.loggers import read_metrics

    run_dir = os.path.join(work, f"ours_{tag}")
    if os.path.exists(run_dir):  # train.py would resume it and the figures would be the old run's
        raise SystemExit(f"{run_dir} holds an earlier run; give vs_trl an empty --work folder")
    a, r = "--actor_rollout_ref.actor", "--actor_rollout_ref.rollout"
    flags = [
        "--preset", "demo_cpu", f"--actor_rollout_ref.model.path={model}",
        f"--data.train_files={data}", "--data.val_files", "--data.apply_chat_template=true",  # no validation set: the harness has none
        "--data.train_batch_size=8", "--data.max_prompt_length=128", "--data.max_response_length=64",
        f"{r}.n=4", f"{r}.temperature=1.0", f"{r}.top_p=1.0", f"{r}.top_k=-1", f"{r}.name=native",
        f"{r}.seed={args.seed}", f"{r}.log_prob_micro_batch_size_per_gpu=16",
        f"{a}.ppo_mini_batch_size=8", f"{a}.ppo_epochs=1", f"{a}.loss_agg_mode=token-mean", f"{a}.clip_ratio=0.2",
        f"{a}.use_kl_loss=false", f"{a}.entropy_coeff=0.0", f"{a}.optim.lr=1e-5", f"{a}.optim.weight_decay=0.0",
        f"{a}.optim.warmup_style=constant", f"{a}.grad_clip=1.0",
        "--actor_rollout_ref.model.enable_gradient_checkpointing=false", "--actor_rollout_ref.model.dtype=fp32",
        "--algorithm.adv_estimator=grpo", "--algorithm.norm_adv_by_std_in_grpo=true",
        "--algorithm.use_kl_in_reward=false",
        f"--reward.custom_fn={os.path.abspath(__file__)}:answer_tag_reward", "--reward.num_workers=0",
        f"--trainer.total_training_steps={args.warmup + args.steps}", "--trainer.test_freq=-1",
        "--trainer.val_before_train=false", "--trainer.save_freq=-1", "--trainer.export_hf=false",
        "--trainer.plot=false", "--trainer.log_samples=0", f"--trainer.default_local_dir={run_dir}",
        *(() if defaults else (
            f"--actor_rollout_ref.model.use_remove_padding={str(args.packing != 'none').lower()}",
            f"--actor_rollout_ref.model.use_shared_prefix={str(args.packing == 'shared_prefix').lower()}")),
        # fp32 master weights either way; bf16: FSDP2 computes in bf16 and the engine samples in bf16
        f"{a}.fsdp_config.mixed_precision.param_dtype={args.precision}", f"{r}.dtype={args.precision}",
        *(real_model_flags() if args.model != "tiny" and not getattr(args, "plain", False) and not defaults else ()),
        *(() if defaults else getattr(args, "ours_flag", [])),
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    m = run_measured(cmd, env, os.path.join(work, f"ours_{tag}.log"), args.run_timeout_s)
    rows = [row for row in read_metrics(run_dir) if row["step"] > args.warmup]
    if not rows:
        raise RuntimeError(f"no measured steps in {run_dir}/metrics.jsonl")
    step_s = [row["timing_s/step"] for row in rows]
    rows_per_step = 8 * 4
    tokens = [row["response_length/mean"] * rows_per_step for row in rows]
    phases = sorted({k for row in rows for k in row if k.startswith("timing_s/") and k != "timing_s/step"})
    return {**m, "sec_per_step": statistics.median(step_s), "tokens_per_step": statistics.median(tokens),
            "tokens_per_s": sum(tokens) / sum(step_s),
            "phases": {k.split("/", 1)[1]: statistics.median(row.get(k, 0.0) for row in rows) for k in phases},
            "step_s": [round(x, 4) for x in step_s]}


# ---------------------------------------------------------------------------------------------- main
def _median_ratio(ours: list[dict], trl: list[dict], key: str) -> float:
    return round(statistics.median(o[key] / t[key] for o, t in zip(ours, trl)), 3)


def _side_summary(runs: list[dict]) -> dict:
    phases = sorted({k for r in runs for k in r["phases"]})
    return {"sec_per_step_median": round(statistics.median(r["sec_per_step"] for r in runs), 4),
            "tokens_per_step_median": statistics.median(r["tokens_per_step"] for r in runs),
            "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
            "phase_medians_s": {p: round(statistics.median(r["phases"].get(p, 0.0) for r in runs), 4)
                                for p in phases},
            "foreign_cpu_frac": [r["foreign_cpu_frac"] for r in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (tinyzero's offline random Qwen2), smollm2, or an HF folder")
    p.add_argument("--trl-python", required=True, help="python of the virtual environment that has TRL")
    p.add_argument("--trl-harness", default=DEFAULT_HARNESS, help="the TRL side's script (it defines make_prompts)")
    p.add_argument("--smollm2-dir", default=os.path.join(ROOT, "runs", "real", "smollm2-135m-instruct"),
                   help="where SmolLM2-135M-Instruct is (converted there with from_gguf when missing)")
    p.add_argument("--rounds", type=int, default=2, help="TRL, ours pairs")
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps per run")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured first steps per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--packing", choices=("none", "remove_padding", "shared_prefix"), default="shared_prefix",
                   help="our side's training-pass packing (actor_rollout_ref.model.use_remove_padding / "
                        "use_shared_prefix); TRL has no equivalent")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="fp32 (the reference workload) or bf16 mixed precision on both sides: TRL's bf16=True "
                        "(autocast, bench/trl_bf16.py), ours FSDP2 param_dtype=bf16 and a bf16 rollout engine; "
                        "fp32 master weights and optimizer on both")
    p.add_argument("--ours-flag", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                   help="an extra train.py flag for our side (repeatable), e.g. "
                        "--ours-flag=--actor_rollout_ref.rollout.sleep_level=2")
    p.add_argument("--plain", action="store_true",
                   help="our side without real_model_flags() on a real model (the demo_cpu settings and the "
                        "workload's own)")
    p.add_argument("--defaults", action="store_true",
                   help="a third side, interleaved: ours with the workload's settings alone (no packing flag, no "
                        "real_model_flags, no --ours-flag), what a new user gets; reports it against TRL and "
                        "against our tuned side (defaults_vs_tuned)")
    p.add_argument("--idle-busy", type=float, default=0.1, help="busy CPU share below which the machine is idle")
    p.add_argument("--idle-wait-s", type=float, default=600.0, help="longest wait for an idle machine per run")
    p.add_argument("--run-timeout-s", type=float, default=3600.0)
    p.add_argument("--work", default=None, help="folder for models, data, logs (default: a temporary one)")
    args = p.parse_args()
    if not os.path.isfile(args.trl_python):
        p.error(f"--trl-python {args.trl_python} does not exist (bench/trl/README.md makes that environment)")
    if not os.path.isfile(args.trl_harness):
        p.error(f"--trl-harness {args.trl_harness} does not exist")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1:
        p.error("--rounds, --steps and --warmup must be >= 1 (the first step warms up)")

    work = args.work or tempfile.mkdtemp(prefix="tinyzero-vs-trl-")
    os.makedirs(work, exist_ok=True)
    model = prepare_model(args.model, work, args.smollm2_dir)
    # As many prompts as the harness draws, so both sides sample from the same set.
    num_prompts = max(256, (args.warmup + args.steps) * 8 * 2)
    data = write_prompts(args.trl_harness, os.path.join(work, "prompts.parquet"), num_prompts, args.seed)
    trl, ours, plain = [], [], []
    sides = (("trl", trl), ("ours", ours)) + ((("ours_defaults", plain),) if args.defaults else ())
    for i in range(args.rounds):
        for side, runs in sides:
            idle = wait_idle(args.idle_busy, args.idle_wait_s)
            if side == "trl":
                res = run_trl(args, model, work, str(i))
            else:
                res = run_ours(args, model, data, work, f"{side[5:]}{i}", defaults=side == "ours_defaults")
            runs.append({**res, **idle})
            print(json.dumps({"round": i, "side": side, **runs[-1]}), flush=True)
    result = {
        "model": args.model, "model_path": model, "rounds": args.rounds, "steps": args.steps,
        "warmup": args.warmup, "packing": args.packing, "plain": args.plain,
        "precision": args.precision,
        "shape": "8 prompts x 4 samples, <= 64 new tokens, 2 procs x 1 thread",
        "step_time_ratio": _median_ratio(ours, trl, "sec_per_step"),
        "tokens_per_s_ratio": _median_ratio(ours, trl, "tokens_per_s"),
        "peak_rss_ratio": _median_ratio(ours, trl, "peak_rss_mib"),
        "ours": _side_summary(ours), "trl": _side_summary(trl),
        "all_idle": all(r["idle"] for r in trl + ours + plain), "work": work,
    }
    if args.defaults:
        result["defaults"] = {"step_time_ratio": _median_ratio(plain, trl, "sec_per_step"),
                              "peak_rss_ratio": _median_ratio(plain, trl, "peak_rss_mib"),
                              "defaults_vs_tuned": _median_ratio(plain, ours, "sec_per_step"),
                              "ours_defaults": _side_summary(plain)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
