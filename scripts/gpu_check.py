"""Proves the GPU paths on one CUDA device, or says which it could not prove; a dry mode runs it all on CPU.

    bash scripts/gpu_check.sh                                # installs what is missing, then runs this
    python scripts/gpu_check.py [--budget-s 420] [--sections kernels,grpo_native] [--summary out.json]
    TRITON_INTERPRET=1 python scripts/gpu_check.py --dry      # CI: every section on CPU at small shapes

Every section reports a status: "ok" only when it ran on CUDA (the parameters' device, GPU memory
allocated) and its checks passed; "failed" when a check failed or it crashed; "not_covered" when it
could not run here (vLLM absent, left out with --sections, out of the time budget), with why. In the
dry mode a section that passes on CPU is "dry_passed": proof that the script runs, not of the GPU
path. The summary's "ok" is true only when every section is "ok".

Sections:
  kernels      Triton kernels against float64 references, forward and backward, fp32 and bf16 inputs, at a
               151,936 vocabulary: log-probs / entropy from logits and from hidden x lm_head, GAE,
               discounted returns, group statistics. Errors ||out - ref|| / ||ref||, limits 1e-5 (fp32
               inputs) and 2e-2 (bf16 inputs).
  precision    the tiny model loaded by the trainer's loader on the device, model.dtype=auto: fp32
               master weights on CUDA, bf16 compute, fp32 gradients and AdamW state, an lr 1e-6 step
               that moves the weights (tinyzero.models.precision).
  packing      packed (remove_padding) and shared-prefix log-probs, entropies and gradients against the
               unpacked path on the device, fp32 and bf16.
  grpo_native  three bf16 GRPO steps through train.py with the native engine, the reference model and a KL
               loss, a checkpoint every step; metrics finite, GPU memory used.
  resume       the same run killed (SIGKILL) once step 2's checkpoint exists, resumed: step 3's metrics
               equal grpo_native's.
  ppo_critic   two GAE PPO steps with a critic through train.py.
  lora         two GRPO steps with LoRA adapters through train.py.
  grpo_vllm    grpo_native with rollout.name=vllm; not_covered when vllm does not import.
  bench_*      the GPU parts of bench/kernels.py, bench/train_scaling.py (per-phase timings, tokens/s,
               MFU of a Qwen2.5-0.5B-shaped actor) and bench/rollout.py (native engine vs HF generate),
               their JSON results in the summary.

The summary (one JSON object) is written to --summary (default: <work>/gpu_check_summary.json) and
printed as the last line. Exit code 0 when "ok" (dry: when no section failed), 1 otherwise, 2 without
a CUDA device outside the dry mode. A bench's JSON is read from its own stdout, not from a tail mixed
with warnings.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 151_936  # Qwen2.5's
SECTIONS = ("kernels", "precision", "packing", "grpo_native", "resume", "ppo_critic", "lora", "grpo_vllm",
            "bench_kernels", "bench_train_scaling", "bench_rollout")
# Rough seconds a section takes on one recent GPU; a section starts only when this much budget is left.
ESTIMATE_S = {"kernels": 20, "precision": 20, "packing": 20, "grpo_native": 45, "resume": 60, "ppo_critic": 45,
              "lora": 45, "grpo_vllm": 120, "bench_kernels": 40, "bench_train_scaling": 90, "bench_rollout": 60}


def rel_err(out, ref) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not bool(out.isfinite().all()):
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Checks:
    """Collects named error figures against their limits."""

    def __init__(self):
        self.figures: dict[str, float] = {}
        self.failed: list[str] = []

    def expect(self, name: str, err: float, limit: float) -> None:
        self.figures[name] = err
        if not err <= limit:  # NaN fails too
            self.failed.append(f"{name}: {err:.3g} > {limit:g}")

    def require(self, name: str, cond: bool, detail: str = "") -> None:
        if not cond:
            self.failed.append(f"{name}{': ' + detail if detail else ''}")


class Ctx:
    """What every section gets: the device, the dry flag, the scratch folder and the deadline."""

    def __init__(self, dry: bool, work: str, deadline: float):
        import torch

        self.dry = dry
        self.dev = torch.device("cpu" if dry else "cuda")
        self.work = work
        self.deadline = deadline

    def left(self) -> float:
        return self.deadline - time.monotonic()


def section_kernels(ctx: Ctx) -> dict:
    """Triton vs float64 references (see the module docstring); tiny shapes under the CPU interpreter."""
    import torch
    from tinyzero.kernels import (
        discounted_returns,
        gae_advantage_return,
        group_mean_std,
        linear_log_probs,
        log_probs_from_logits,
    )

    dev, small = ctx.dev, ctx.dry
    # The dry mode runs the Triton kernels under the interpreter when TRITON_INTERPRET=1, else the torch path.
    backend = "triton" if not ctx.dry or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    g = torch.Generator(device=dev).manual_seed(1234)
    c = Checks()

    def ref_lp(logits, labels, t):
        z = logits.double() / t
        logp = torch.log_softmax(z, -1)
        ent = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, labels[..., None])[..., 0], ent

    for dtype, limit in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        tag = "fp32" if dtype == torch.float32 else "bf16"
        tokens, vocab = (16, 300) if small else (1024, VOCAB)
        logits = (torch.randn(tokens, vocab, device=dev, generator=g) * 4).to(dtype).requires_grad_(True)
        labels = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
        lp, ent = log_probs_from_logits(logits, labels, temperature=0.7, return_entropy=True, backend=backend)
        x64 = logits.detach().double().requires_grad_(True)
        rlp, rent = ref_lp(x64, labels, 0.7)
        c.expect(f"logprob_{tag}", rel_err(lp, rlp), limit)
        c.expect(f"entropy_{tag}", rel_err(ent, rent), limit)
        glp, gent = torch.randn(tokens, device=dev, generator=g), torch.randn(tokens, device=dev, generator=g)
        (lp * glp + ent * gent).sum().backward()
        (rlp * glp.double() + rent * gent.double()).sum().backward()
        c.expect(f"logprob_grad_{tag}", rel_err(logits.grad, x64.grad), limit)
        # Peaked rows (logit scale 30): where entropy collapse is monitored.
        peaked = (torch.randn(tokens, vocab, device=dev, generator=g) * 30).to(dtype)
        _, pent = log_probs_from_logits(peaked, labels, return_entropy=True, backend=backend)
        _, rpent = ref_lp(peaked, labels, 1.0)
        c.figures[f"entropy_peaked_abs_{tag}"] = float((pent.double() - rpent).abs().max())

        hidden_size = 16 if small else 896
        hidden = (torch.randn(tokens, hidden_size, device=dev, generator=g)).to(dtype).requires_grad_(True)
        weight = (torch.randn(vocab, hidden_size, device=dev, generator=g) * 0.05).to(dtype).requires_grad_(True)
        lp, ent = linear_log_probs(hidden, weight, labels, temperature=0.7, return_entropy=True, backend=backend)
        h64 = hidden.detach().double().requires_grad_(True)
        w64 = weight.detach().double().requires_grad_(True)
        rlp, rent = ref_lp(h64 @ w64.T, labels, 0.7)
        c.expect(f"linear_logprob_{tag}", rel_err(lp, rlp), limit)
        c.expect(f"linear_entropy_{tag}", rel_err(ent, rent), limit)
        (lp * glp + ent * gent).sum().backward()
        (rlp * glp.double() + rent * gent.double()).sum().backward()
        c.expect(f"linear_grad_hidden_{tag}", rel_err(hidden.grad, h64.grad), limit)
        c.expect(f"linear_grad_weight_{tag}", rel_err(weight.grad, w64.grad), limit)

    # Advantages: a plain float64 loop over right-padded rows.
    rows, length, gamma, lam = (4, 40, 0.99, 0.95) if small else (64, 1024, 0.99, 0.95)
    lengths = torch.randint(1, length + 1, (rows,), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    rewards = torch.randn(rows, length, dtype=torch.float64) * mask
    values = torch.randn(rows, length, dtype=torch.float64) * mask
    adv_ref = torch.zeros(rows, length, dtype=torch.float64)
    ret_ref = torch.zeros(rows, length, dtype=torch.float64)
    disc_ref = torch.zeros(rows, length, dtype=torch.float64)
    for i in range(rows):
        last_gae, nxt, run = 0.0, 0.0, 0.0
        for t in reversed(range(int(lengths[i]))):
            delta = float(rewards[i, t]) + gamma * nxt - float(values[i, t])
            last_gae = delta + gamma * lam * last_gae
            adv_ref[i, t] = last_gae
            ret_ref[i, t] = last_gae + float(values[i, t])
            nxt = float(values[i, t])
            run = float(rewards[i, t]) + gamma * run
            disc_ref[i, t] = run
    adv, ret = gae_advantage_return(rewards.float().to(dev), values.float().to(dev), mask.to(dev), gamma, lam,
                                    backend=backend)
    c.expect("gae_advantages", rel_err(adv * mask.to(dev), adv_ref), 1e-5)
    c.expect("gae_returns", rel_err(ret * mask.to(dev), ret_ref), 1e-5)
    disc = discounted_returns(rewards.float().to(dev), mask.to(dev), gamma, backend=backend)
    c.expect("discounted_returns", rel_err(disc * mask.to(dev), disc_ref), 1e-5)

    n, groups = (64, 8) if small else (4096, 512)
    scores = torch.randn(n, dtype=torch.float64)
    ids = torch.randint(0, groups, (n,), generator=torch.Generator().manual_seed(1))
    mean, std, _ = group_mean_std(scores.float().to(dev), ids.to(dev), groups, backend=backend)
    mean_ref = torch.stack([scores[ids == k].mean() if (ids == k).any() else torch.tensor(0.0, dtype=torch.float64)
                            for k in range(groups)])
    c.expect("group_mean", rel_err(mean, mean_ref), 1e-5)
    counts = torch.bincount(ids, minlength=groups)
    std_ref = torch.stack([scores[ids == k].std() if counts[k] > 1 else torch.tensor(float("nan"))
                           for k in range(groups)])
    multi = counts > 1
    c.expect("group_std", rel_err(std.cpu()[multi], std_ref[multi]), 1e-5)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        # The hang watchdog's view of a rank blocked in a host sync: queued GPU work shows as pending
        # (it waits for its GPU, not stuck), and nothing once the stream drained.
        from tinyzero.runtime.progress import _gpu_pending

        a = torch.randn(4096, 4096, device=dev)
        for _ in range(200):
            a = a @ a / 64.0
        c.require("watchdog sees queued GPU work", _gpu_pending(dev.index or 0))
        torch.cuda.synchronize()
        c.require("watchdog sees a drained stream", not _gpu_pending(dev.index or 0))
    return {"backend": backend, "failed": c.failed, "errors": c.figures, "on_device": str(logits.device),
            "gpu_mem_bytes": torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0}


# --------------------------------------------------------------------------- in a child process


def child_precision(dry: bool) -> dict:
    """Load the tiny model with the trainer's loader (model.dtype=auto), take one AdamW step at lr 1e-6."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.models.config import FSDPConfig, MixedPrecisionConfig, ModelConfig
    from tinyzero.models.fsdp import load_sharded_model
    from tinyzero.models.precision import resolve_precision
    from tinyzero.workers.config import OptimConfig
    from tinyzero.workers.optim import build_optimizer

    init_distributed()
    set_seed(0)
    kind = "cpu" if dry else "cuda"
    mp = MixedPrecisionConfig()
    if dry:  # resolve as on CUDA (availability faked after the CPU group is up); compute in bf16 on CPU
        torch.cuda.is_available = lambda: True
        torch.cuda.is_bf16_supported = lambda *a, **k: True
        mp = MixedPrecisionConfig(param_dtype="bf16")
    model_cfg = ModelConfig(path=_tiny_model(), dtype="auto", enable_gradient_checkpointing=False)
    fsdp = FSDPConfig(mixed_precision=mp)
    policy = resolve_precision(model_cfg, FSDPConfig(), "cuda", trainable=True)
    mesh = init_device_mesh(kind, (1,), mesh_dim_names=("dp_shard",))
    model = load_sharded_model(model_cfg, fsdp, mesh, kind="causal_lm")
    optim = build_optimizer(model.parameters(), OptimConfig(lr=1e-6, weight_decay=0.0))
    local = lambda p: p.detach().to_local() if hasattr(p, "to_local") else p.detach()  # noqa: E731
    before = {n: local(p).clone() for n, p in model.named_parameters()}
    dev = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    ids = torch.randint(0, 200, (4, 64), generator=torch.Generator().manual_seed(0)).to(dev)
    logits = model(input_ids=ids).logits
    torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean().backward()
    optim.step()
    c = Checks()
    params = {n: (local(p).dtype, local(p).device.type) for n, p in model.named_parameters()}
    c.require("master weights fp32", {d for d, _ in params.values()} == {torch.float32}, str(set(params.values())))
    c.require("parameters on the device", {t for _, t in params.values()} == {dev.type})
    grads = {local(p.grad).dtype for p in model.parameters() if p.grad is not None}
    c.require("gradients fp32", grads == {torch.float32}, str(grads))
    states = {v.dtype for s in optim.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}
    c.require("AdamW state fp32", states == {torch.float32}, str(states))
    c.require("compute bf16", logits.dtype == torch.bfloat16, str(logits.dtype))
    c.require("policy: bf16 compute on CUDA", policy.compute_dtype == torch.bfloat16, str(policy))
    moved = sum(int((local(p) != before[n]).sum()) for n, p in model.named_parameters())
    frac = moved / sum(v.numel() for v in before.values())
    c.require("an lr 1e-6 step moves > 90% of the weights", frac > 0.9, f"{frac:.3f}")
    return {"failed": c.failed, "moved_frac": round(frac, 4), "on_device": str(local(next(model.parameters())).device),
            "gpu_mem_bytes": torch.cuda.max_memory_allocated() if kind == "cuda" else 0}


def _grouped_batch(groups: int, n: int, prompt_len: int, resp_len: int, vocab: int, dev):
    """Left-padded prompts shared by the n responses of a group, right-padded responses of varied lengths."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows, p, r = groups * n, prompt_len, resp_len
    ids = torch.randint(3, vocab, (rows, p + r), generator=g)
    attn = torch.zeros(rows, p + r, dtype=torch.long)
    for i in range(rows):
        group = i // n
        ids[i, :p] = ids[group * n, :p]
        lp, lr = 2 + (group * 3) % (p - 1), 1 + (i * 5) % r
        attn[i, p - lp:p] = 1
        attn[i, p:p + lr] = 1
    ids = torch.where(attn.bool(), ids, torch.zeros_like(ids))
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    batch = {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": ids[:, p:],
             "response_mask": attn[:, p:].float()}
    return {k: v.to(dev) for k, v in batch.items()}


def child_packing(dry: bool) -> dict:
    """Packed and shared-prefix log-probs, entropies and gradients against the unpacked path."""
    import torch
    from transformers import AutoModelForCausalLM

    from tinyzero.workers.forward import attach_log_prob_method, response_log_probs
    from tinyzero.workers.packing import prepare_attention

    dev = torch.device("cpu" if dry else "cuda")
    c = Checks()
    for dtype, limit in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        tag = "fp32" if dtype == torch.float32 else "bf16"
        results = {}
        for mode in ("none", "remove_padding", "shared_prefix"):
            model = AutoModelForCausalLM.from_pretrained(_tiny_model(), dtype=dtype, attn_implementation="sdpa").to(dev)
            prepare_attention(model, mode)
            attach_log_prob_method(model)
            b = _grouped_batch(4, 4, 24, 16, model.config.vocab_size, dev)
            mask = b["response_mask"].bool()
            weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)).to(dev)
            lp, ent = response_log_probs(model, b, 1.0, True, mode)
            ((lp.float() * weights)[mask].sum() + ent.float()[mask].sum()).backward()
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
            results[mode] = lp.detach()[mask], ent.detach()[mask], grads
        base = results["none"]
        for mode in ("remove_padding", "shared_prefix"):
            lp, ent, grads = results[mode]
            c.expect(f"{mode}_logprob_{tag}", rel_err(lp, base[0]), limit)
            c.expect(f"{mode}_entropy_{tag}", rel_err(ent, base[1]), limit)
            c.expect(f"{mode}_grad_{tag}", rel_err(grads, base[2]), limit * 10 if tag == "bf16" else 1e-4)
    return {"failed": c.failed, "errors": c.figures, "on_device": str(lp.device),
            "gpu_mem_bytes": torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0}


CHILDREN = {"precision": child_precision, "packing": child_packing}


def _tiny_model() -> str:
    return os.path.join(os.environ["GPU_CHECK_WORK"], "tiny_model")


def run_child(name: str, ctx: Ctx) -> dict:
    """Run CHILDREN[name] in a fresh python (its own process group); its result comes back in a file."""
    out = os.path.join(ctx.work, f"{name}.json")
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--work", ctx.work] + (["--dry"] if ctx.dry
                                                                                               else [])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    code, tail, _ = run(cmd, max(10.0, ctx.left()), env=env)
    if code != 0 or not os.path.exists(out):
        return {"failed": [f"exit code {code}"], "tail": tail}
    with open(out) as f:
        return json.load(f)


# --------------------------------------------------------------------------- train.py runs


def run(cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[int, str, str]:
    """(exit code, last 4000 characters of stdout + stderr, the whole stdout); 124 on timeout."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        return proc.returncode, (proc.stdout + proc.stderr)[-4000:], proc.stdout
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return 124, (out.decode(errors="replace") if isinstance(out, bytes) else out)[-4000:], ""


def last_json(text: str) -> dict | None:
    """The last line of `text` that is a JSON object."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def prepare_assets(work: str) -> None:
    """The offline tiny model and the demo's parquets under `work` (built once)."""
    from tinyzero.demo import build_data
    from tinyzero.models.tiny import build_tiny_model

    if not os.path.exists(os.path.join(work, "tiny_model", "config.json")):
        build_tiny_model(os.path.join(work, "tiny_model"), seed=0)
    if not os.path.exists(os.path.join(work, "data", "train.parquet")):
        build_data(os.path.join(work, "data"))


def train_cmd(ctx: Ctx, run_dir: str, steps: int, extra: list[str]) -> list[str]:
    """train.py under torchrun: the demo preset on the tiny model, on the device, model.dtype=auto and the
    default mixed precision (bf16 compute on CUDA, fp32 on CPU), the reference model and a KL loss."""
    import torch

    nproc = 1 if ctx.dry else max(1, min(2, torch.cuda.device_count()))
    arr = "--actor_rollout_ref"
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py",
            "--preset", "demo_cpu", f"--trainer.device={ctx.dev.type}", f"{arr}.model.path={ctx.work}/tiny_model",
            f"--data.train_files={ctx.work}/data/train.parquet", f"--data.val_files={ctx.work}/data/test.parquet",
            f"--trainer.default_local_dir={run_dir}", f"--trainer.total_training_steps={steps}",
            "--trainer.test_freq=-1", "--trainer.val_before_train=false", "--trainer.plot=false",
            "--data.train_batch_size=8", f"{arr}.actor.ppo_mini_batch_size=8", f"{arr}.rollout.n=4",
            f"{arr}.model.dtype=auto", f"{arr}.actor.fsdp_config.mixed_precision.param_dtype=auto",
            f"{arr}.ref.fsdp_config.mixed_precision.param_dtype=auto",
            f"{arr}.actor.use_kl_loss=true", f"{arr}.actor.kl_loss_coef=0.01",
            # The untrained tiny model scores 0 everywhere (zero advantages): the entropy bonus makes every
            # step move the weights, so the KL to the reference is non-zero from step 2.
            f"{arr}.actor.entropy_coeff=0.01", *extra]


KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean")


def train_result(ctx: Ctx, run_dir: str, code: int, tail: str, steps: int, want: tuple = KEYS) -> dict:
    """Checks on a finished train.py run: exit 0, `steps` rows with finite `want` metrics, GPU memory used."""
    from tinyzero.trainer.loggers import read_metrics

    c = Checks()
    c.require("exit code 0", code == 0, str(code))
    rows = [r for r in read_metrics(run_dir) if "actor/pg_loss" in r] if code == 0 else []
    c.require(f"{steps} steps logged", len(rows) == steps, str(len(rows)))
    for r in rows:
        for k in want:
            c.require(f"step {r.get('step')} {k} finite", k in r and math.isfinite(float(r[k])), str(r.get(k)))
    for r in rows:
        c.require(f"step {r.get('step')} the actor stepped", float(r.get("actor/grad_norm", 0.0)) > 0,
                  str(r.get("actor/grad_norm")))
    mem = max((float(r.get("perf/max_memory_allocated_gb/actor", 0.0)) for r in rows), default=0.0)
    out = {"failed": c.failed, "rows": {int(r["step"]): {k: r.get(k) for k in (*want, "timing_s/step")}
                                        for r in rows},
           "on_device": "cuda" if mem > 0 else "cpu", "gpu_mem_bytes": int(mem * 2**30)}
    if c.failed:
        out["tail"] = tail
    return out


def section_grpo_native(ctx: Ctx) -> dict:
    run_dir = os.path.join(ctx.work, "grpo_native")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = train_cmd(ctx, run_dir, 3, ["--trainer.save_freq=1", "--trainer.resume_mode=disable",
                                      "--actor_rollout_ref.rollout.name=native"])
    code, tail, _ = run(cmd, max(10.0, ctx.left()))
    out = train_result(ctx, run_dir, code, tail, 3, (*KEYS, "actor/kl_loss"))
    kl = out["rows"].get(3, {}).get("actor/kl_loss")
    if not out["failed"] and not (kl is not None and float(kl) > 0):
        out["failed"].append(f"step 3 actor/kl_loss={kl}: the reference model and KL did not act")
    return out


def section_resume(ctx: Ctx) -> dict:
    """grpo_native's run, SIGKILLed once step 2's checkpoint is complete, then resumed to step 3."""
    run_dir = os.path.join(ctx.work, "resume")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = train_cmd(ctx, run_dir, 3, ["--trainer.save_freq=1", "--trainer.resume_mode=auto",
                                      "--actor_rollout_ref.rollout.name=native"])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    killed, end = False, time.monotonic() + max(10.0, ctx.left() / 2)
    while proc.poll() is None and time.monotonic() < end:
        if glob.glob(os.path.join(run_dir, "**", "global_step_2"), recursive=True):
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.05)
    if proc.poll() is None and not killed:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if not killed:  # the run ended before the kill: drop step 3's checkpoint so the resume still starts at 2
        for path in glob.glob(os.path.join(run_dir, "**", "global_step_3"), recursive=True):
            shutil.rmtree(path)
    code, tail, _ = run(cmd, max(10.0, ctx.left()))
    out = train_result(ctx, run_dir, code, tail, 3)
    out["killed_at_step_2"] = killed
    ref = os.path.join(ctx.work, "grpo_native", "metrics.jsonl")
    if not os.path.exists(ref):
        out["failed"].append("grpo_native did not run: nothing to compare with")
        return out
    from tinyzero.trainer.loggers import read_metrics

    want = {int(r["step"]): r for r in read_metrics(os.path.dirname(ref)) if "actor/pg_loss" in r}.get(3, {})
    got = out["rows"].get(3, {})
    for k in KEYS:
        a, b = got.get(k), want.get(k)
        # Sampling, scores and lengths replay exactly from the checkpointed RNG; losses may differ in the
        # last bits where GPU reductions are not deterministic.
        same = a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-3, abs_tol=1e-6)
        if not same:
            out["failed"].append(f"step 3 {k}: resumed {a} != uninterrupted {b}")
    return out


def section_ppo_critic(ctx: Ctx) -> dict:
    run_dir = os.path.join(ctx.work, "ppo_critic")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = train_cmd(ctx, run_dir, 2, ["--trainer.save_freq=-1", "--trainer.resume_mode=disable",
                                      "--algorithm.adv_estimator=gae", f"--critic.model.path={ctx.work}/tiny_model",
                                      "--critic.model.dtype=auto"])
    code, tail, _ = run(cmd, max(10.0, ctx.left()))
    return train_result(ctx, run_dir, code, tail, 2, (*KEYS, "critic/vf_loss"))


def section_lora(ctx: Ctx) -> dict:
    run_dir = os.path.join(ctx.work, "lora")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = train_cmd(ctx, run_dir, 2, ["--trainer.save_freq=-1", "--trainer.resume_mode=disable",
                                      "--actor_rollout_ref.model.lora_rank=8"])
    code, tail, _ = run(cmd, max(10.0, ctx.left()))
    return train_result(ctx, run_dir, code, tail, 2)


def section_grpo_vllm(ctx: Ctx) -> dict:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"not_covered": "vllm is not installed here"}
    if ctx.dry:
        return {"not_covered": "the dry mode does not start vLLM"}
    run_dir = os.path.join(ctx.work, "grpo_vllm")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = train_cmd(ctx, run_dir, 2, ["--trainer.save_freq=-1", "--trainer.resume_mode=disable",
                                      "--actor_rollout_ref.rollout.name=vllm",
                                      "--actor_rollout_ref.rollout.gpu_memory_utilization=0.3"])
    code, tail, _ = run(cmd, max(10.0, ctx.left()))
    return train_result(ctx, run_dir, code, tail, 2)


def bench(ctx: Ctx, script: str, gpu_args: list[str], dry_args: list[str], ran_on_gpu) -> dict:
    """A bench script's JSON result, read from its own stdout; `ran_on_gpu(result)` says whether its GPU part ran."""
    code, tail, stdout = run([sys.executable, script, *(dry_args if ctx.dry else gpu_args)], max(10.0, ctx.left()))
    result = last_json(stdout)
    if code != 0 or result is None:
        return {"failed": [f"exit code {code}, JSON result found: {result is not None}"], "tail": tail}
    on_gpu = not ctx.dry and bool(ran_on_gpu(result))
    return {"failed": [], "result": result, "on_device": "cuda" if on_gpu else "cpu", "gpu_mem_bytes": int(on_gpu)}


def section_bench_kernels(ctx: Ctx) -> dict:
    gpu = ["--rounds", "2", "--mem-rounds", "1", "--tokens", "256", "--gae-rounds", "2"]
    return bench(ctx, "bench/kernels.py", gpu, ["--gpu-dry-run"],
                 lambda r: isinstance(r.get("gpu"), dict) and "skipped" not in r["gpu"])


def section_bench_train_scaling(ctx: Ctx) -> dict:
    return bench(ctx, "bench/train_scaling.py", ["--gpu", "--skip_cpu", "--long_seq", "0"],
                 ["--gpu_dry", "--skip_cpu", "--long_seq", "0"], lambda r: r.get("gpu") and not r.get("gpu_dry"))


def section_bench_rollout(ctx: Ctx) -> dict:
    small = ["--rounds", "1", "--skip_vllm", "--skip_sync", "--batch", "4", "--new_tokens", "8"]
    return bench(ctx, "bench/rollout.py", [*small, "--gpu_batch", "128", "--gpu_new_tokens", "256"], small,
                 lambda r: "gpu_native_tokens_per_s" in r)


# --------------------------------------------------------------------------- the runner


def run_section(name: str, ctx: Ctx) -> dict:
    """One section's result with its status; "ok" needs the checks passed and proof it ran on CUDA."""
    start = time.monotonic()
    try:
        res = run_child(name, ctx) if name in CHILDREN else globals()[f"section_{name}"](ctx)
    except Exception:  # a crash is a failed check, reported with its traceback
        res = {"failed": ["crashed"], "error": traceback.format_exc()[-3000:]}
    res["seconds"] = round(time.monotonic() - start, 1)
    return finish(res, ctx.dry)


def finish(res: dict, dry: bool) -> dict:
    """Set status and ok: ok only for a section that passed and shows CUDA use (device and memory)."""
    if "not_covered" in res:
        res["status"] = "not_covered"
    elif res.get("failed"):
        res["status"] = "failed"
    elif dry:
        res["status"] = "dry_passed"
    elif not (str(res.get("on_device", "")).startswith("cuda") and res.get("gpu_mem_bytes", 0) > 0):
        res["status"] = "failed"
        res.setdefault("failed", []).append("no proof it ran on CUDA (device of the tensors, GPU memory used)")
    else:
        res["status"] = "ok"
    res["ok"] = res["status"] == "ok"
    return res


def summarize(sections: dict, seconds: float, dry: bool) -> dict:
    return {"ok": bool(sections) and all(s["status"] == "ok" for s in sections.values()), "dry": dry,
            "seconds": round(seconds, 1), "not_covered": [k for k, s in sections.items() if s["status"] == "not_covered"],
            "failed": [k for k, s in sections.items() if s["status"] == "failed"], "sections": sections}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=420, help="wall-clock budget for all sections")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {','.join(SECTIONS)}")
    p.add_argument("--dry", action="store_true", help="run every section on CPU at small shapes (CI)")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--summary", default=None, help="where the JSON summary is written (default: in --work)")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="tinyzero_gpu_check_"))
    os.makedirs(work, exist_ok=True)
    os.environ["GPU_CHECK_WORK"] = work
    if args.child:
        res = CHILDREN[args.child](args.dry)
        with open(os.path.join(work, f"{args.child}.json"), "w") as f:
            json.dump(res, f)
        return 0
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    summary_path = args.summary or os.path.join(work, "gpu_check_summary.json")
    start = time.monotonic()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "work": work,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    sections: dict[str, dict] = {}
    if not args.dry and not torch.cuda.is_available():
        sections = {n: finish({"not_covered": "no CUDA device visible"}, False) for n in SECTIONS}
        code = 2
    else:
        prepare_assets(work)
        ctx = Ctx(args.dry, work, start + args.budget_s)
        for name in SECTIONS:
            if name not in chosen:
                sections[name] = finish({"not_covered": "not selected (--sections)"}, args.dry)
            elif ctx.left() < ESTIMATE_S[name] and not args.dry:
                sections[name] = finish({"not_covered": f"out of the time budget ({ctx.left():.0f} s left)"}, False)
            else:
                sections[name] = run_section(name, ctx)
            print(json.dumps({name: {k: sections[name].get(k) for k in ("status", "seconds", "failed")}}), flush=True)
        code = None
    summary = {**summarize(sections, time.monotonic() - start, args.dry), "env": env}
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary), flush=True)
    if code is not None:
        return code
    if args.dry:
        return 1 if summary["failed"] else 0
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
