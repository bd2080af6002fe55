"""Everything GPU-only in one run: kernels, a bf16 FSDP2 GRPO run, the GPU sections of the benches.

    bash scripts/gpu_check.sh                  # installs what is missing, then runs this
    python scripts/gpu_check.py [--budget-s 480] [--skip-bench]
    TRITON_INTERPRET=1 python scripts/gpu_check.py --kernels-dry-run   # kernel checks on CPU, tiny shapes

Sections (each bounded in time; a section that fails or times out fails the whole check):
  kernels     Triton kernels on CUDA against float64 torch references, forward and backward:
              log-probs / entropy from logits (fp32 and bf16 logits), linear_log_probs (hidden x
              lm_head, fp32 and bf16), GAE, discounted returns and group statistics. Every
              preallocated output is random data, never zeros; errors are ||out - ref|| / ||ref||,
              limits 1e-5 (fp32 outputs from fp32 inputs), 2e-2 (bf16 inputs).
  grpo_native two GRPO steps through train.py (torchrun, 1 rank per visible GPU, at most 2) with
              the offline tiny model in bf16 (FSDP2 mixed precision, native rollout engine);
              metrics must be finite and the actor must have stepped.
  grpo_vllm   the same with rollout.name=vllm, when vllm imports (skipped otherwise, with why).
  bench_*     the GPU sections of bench/kernels.py, bench/rollout.py and bench/train_scaling.py,
              their JSON last lines copied into the summary (figures, not pass/fail).

The last line printed is one JSON object: {"ok": bool, "sections": {name: {...}}}; the exit code
is 1 when any check failed, 2 when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def check_kernels(dev, small: bool = False) -> dict:
    """Triton vs float64 references on `dev` (see module docstring); `small` for the CPU interpreter."""
    import torch
    from tinyzero.kernels import (
        discounted_returns,
        gae_advantage_return,
        group_mean_std,
        linear_log_probs,
        log_probs_from_logits,
    )

    g = torch.Generator(device=dev).manual_seed(1234)
    c = Checks()

    def ref_lp(logits, labels, t):
        z = logits.double() / t
        logp = torch.log_softmax(z, -1)
        ent = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, labels[..., None])[..., 0], ent

    for dtype, limit in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        tag = "fp32" if dtype == torch.float32 else "bf16"
        tokens, vocab = (16, 300) if small else (2048, 50_000)
        logits = (torch.randn(tokens, vocab, device=dev, generator=g) * 4).to(dtype).requires_grad_(True)
        labels = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
        lp, ent = log_probs_from_logits(logits, labels, temperature=0.7, return_entropy=True, backend="triton")
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
        _, pent = log_probs_from_logits(peaked, labels, return_entropy=True, backend="triton")
        _, rpent = ref_lp(peaked, labels, 1.0)
        c.figures[f"entropy_peaked_abs_{tag}"] = float((pent.double() - rpent).abs().max())

        hidden_size = 16 if small else 512
        hidden = (torch.randn(tokens, hidden_size, device=dev, generator=g)).to(dtype).requires_grad_(True)
        weight = (torch.randn(vocab, hidden_size, device=dev, generator=g) * 0.05).to(dtype).requires_grad_(True)
        lp, ent = linear_log_probs(hidden, weight, labels, temperature=0.7, return_entropy=True, backend="triton")
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
                                    backend="triton")
    c.expect("gae_advantages", rel_err(adv * mask.to(dev), adv_ref), 1e-5)
    c.expect("gae_returns", rel_err(ret * mask.to(dev), ret_ref), 1e-5)
    disc = discounted_returns(rewards.float().to(dev), mask.to(dev), gamma, backend="triton")
    c.expect("discounted_returns", rel_err(disc * mask.to(dev), disc_ref), 1e-5)

    n, groups = (64, 8) if small else (4096, 512)
    scores = torch.randn(n, dtype=torch.float64)
    ids = torch.randint(0, groups, (n,), generator=torch.Generator().manual_seed(1))
    mean, std, _ = group_mean_std(scores.float().to(dev), ids.to(dev), groups, backend="triton")
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
    return {"ok": not c.failed, "failed": c.failed, "errors": c.figures}


def run(cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[int, str]:
    """(exit code, last 4000 characters of output); 124 on timeout."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        return proc.returncode, (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return 124, (out.decode(errors="replace") if isinstance(out, bytes) else out)[-4000:]


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def check_grpo(work: str, rollout: str, timeout_s: float) -> dict:
    """Two bf16 GRPO steps of the tiny model through train.py; metrics finite, the actor stepped."""
    import torch

    from tinyzero.demo import build_data
    from tinyzero.models.tiny import build_tiny_model
    from tinyzero.trainer.loggers import read_metrics

    model_dir, data_dir = os.path.join(work, "tiny_model"), os.path.join(work, "data")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_tiny_model(model_dir, seed=0)
        build_data(data_dir)
    run_dir = os.path.join(work, f"grpo_{rollout}")
    nproc = max(1, min(2, torch.cuda.device_count()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py",
           "--preset", "demo_cpu", f"--actor_rollout_ref.model.path={model_dir}",
           f"--data.train_files={data_dir}/train.parquet", f"--data.val_files={data_dir}/test.parquet",
           f"--trainer.default_local_dir={run_dir}", "--trainer.total_training_steps=2",
           "--trainer.resume_mode=disable", "--trainer.save_freq=-1", "--trainer.test_freq=-1",
           "--trainer.val_before_train=false", "--trainer.plot=false",
           "--actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
           f"--actor_rollout_ref.rollout.name={rollout}"]
    if rollout == "vllm":
        cmd.append("--actor_rollout_ref.rollout.gpu_memory_utilization=0.3")
    code, tail = run(cmd, timeout_s)
    out: dict = {"exit_code": code, "nproc": nproc}
    if code != 0:
        return {**out, "ok": False, "tail": tail}
    rows = [r for r in read_metrics(run_dir) if "actor/pg_loss" in r]
    keys = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "timing_s/step", "timing_s/gen")
    bad = [f"step {r.get('step')}: {k}={r.get(k)}" for r in rows for k in keys
           if k in r and not math.isfinite(float(r[k]))]
    out.update({"steps_logged": len(rows), "last": {k: rows[-1].get(k) for k in keys} if rows else {}})
    if len(rows) != 2 or bad:
        return {**out, "ok": False, "failed": bad or [f"{len(rows)} steps logged, 2 expected"], "tail": tail}
    return {**out, "ok": True}


def bench(script: str, args: list[str], timeout_s: float) -> dict:
    code, tail = run([sys.executable, script, *args], timeout_s)
    result = last_json(tail)
    if code != 0 or result is None:
        return {"ok": False, "exit_code": code, "tail": tail}
    return {"ok": True, "result": result}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=480, help="wall-clock budget for all sections")
    p.add_argument("--skip-bench", action="store_true", help="checks only, no benchmark sections")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--kernels-dry-run", action="store_true",
                   help="the kernel section only, on CPU at tiny shapes (needs TRITON_INTERPRET=1)")
    args = p.parse_args()
    import torch

    if args.kernels_dry_run:
        result = check_kernels(torch.device("cpu"), small=True)
        print(json.dumps({"ok": result["ok"], "sections": {"kernels": result}}))
        return 0 if result["ok"] else 1
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device visible; run this on a GPU machine"}))
        return 2
    start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - start)  # noqa: E731
    work = args.work or tempfile.mkdtemp(prefix="tinyzero_gpu_check_")
    sections: dict[str, dict] = {"env": {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                                         "gpus": torch.cuda.device_count()}}
    try:
        sections["kernels"] = check_kernels(torch.device("cuda"))
    except Exception:  # a crash is a failed check, reported with its traceback
        sections["kernels"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
    print(json.dumps({"kernels": sections["kernels"]}), flush=True)
    sections["grpo_native"] = check_grpo(work, "native", min(150, left()))
    try:
        import vllm  # noqa: F401

        sections["grpo_vllm"] = check_grpo(work, "vllm", min(180, left()))
    except ImportError as e:
        sections["grpo_vllm"] = {"ok": True, "skipped": f"vllm does not import: {e}"}
    if not args.skip_bench:
        plan = [("bench_kernels", "bench/kernels.py", ["--quick"]),
                ("bench_train_scaling", "bench/train_scaling.py", ["--gpu", "--skip_cpu"]),
                ("bench_rollout", "bench/rollout.py", ["--rounds", "1", "--skip_vllm"])]
        for name, script, extra in plan:
            if left() < 30:
                sections[name] = {"ok": True, "skipped": "out of the time budget"}
                continue
            sections[name] = bench(script, extra, left() - 10)
    ok = all(s.get("ok", True) for s in sections.values())
    print(json.dumps({"ok": ok, "seconds": round(time.monotonic() - start, 1), "sections": sections}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
