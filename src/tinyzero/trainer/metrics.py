"""Step metrics with veRL's names: data statistics, timing, throughput, rollout/trainer mismatch.

    with timer("gen", timing):           # timing_s/gen
        ...
    metrics.update(compute_data_metrics(batch, use_critic))
    metrics.update(compute_timing_metrics(batch, timing))
    metrics.update(compute_throughput_metrics(batch, timing, num_ranks))

Every function reads a DataProto after the step's phases and returns {name: float}; values are
reduced on the device and turned into Python floats once, at the end of each function.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import torch

from tinyzero.algorithms import rollout_mismatch_metrics
from tinyzero.protocol import DataProto
from tinyzero.runtime.host_memory import phase_done
from tinyzero.runtime.progress import report_progress


@contextmanager
def timer(name: str, timing: dict[str, float]):
    """Add the wall time of the block to timing[name] (seconds); the phase counts as progress. At its end
    the host heaps' free pages go back to the system if they hold more than trainer.host_trim_threshold_mb
    (tinyzero.runtime.host_memory.phase_done, timed with the phase)."""
    report_progress(name)
    start = time.perf_counter()
    try:
        yield
    finally:
        phase_done()
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
    if values.numel() == 0:
        values = torch.zeros(1)
    values = values.float()
    return {f"{prefix}/mean": values.mean(), f"{prefix}/max": values.max(), f"{prefix}/min": values.min()}


def _lengths(batch: DataProto) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(prompt lengths, response lengths, prompt width, response width) from the attention mask, as veRL counts
    them: a multi-turn response's observation tokens count in its length."""
    max_resp = batch.batch["responses"].shape[-1]
    attn = batch.batch["attention_mask"]
    return attn[:, :-max_resp].sum(-1).float(), attn[:, -max_resp:].sum(-1).float(), attn.shape[-1] - max_resp, max_resp


def compute_data_metrics(batch: DataProto, use_critic: bool, tis_cap: float | None = None) -> dict[str, float]:
    """veRL's compute_data_metrics: critic/score|rewards (over the responses that are not aborted, i.e. not empty),
    critic/advantages|returns|values, response_length/*, response_length_non_aborted/*, response/aborted_ratio,
    prompt_length/*; and the rollout / trainer mismatch (algorithms.rollout_mismatch_metrics: training/rollout_*,
    rollout_corr/*; tis_cap: the actor's tis_imp_ratio_cap). A multi-turn rollout's num_turns/* come with the
    agent/* metrics (tinyzero.agent.metrics)."""
    b = batch.batch
    prompt_len, response_len, max_prompt, max_resp = _lengths(batch)
    mask = (b["response_mask"] if "response_mask" in b else b["attention_mask"][:, -max_resp:]).bool()
    kept = response_len > 0  # (rows,): veRL calls an empty response aborted
    out: dict[str, torch.Tensor] = {}
    out.update(_stats("critic/score", b["token_level_scores"].sum(-1)[kept]))
    rewards = b["token_level_rewards"] if "token_level_rewards" in b else b["token_level_scores"]
    out.update(_stats("critic/rewards", rewards.sum(-1)[kept]))
    if "advantages" in b:
        out.update(_stats("critic/advantages", torch.masked_select(b["advantages"], mask)))
        out.update(_stats("critic/returns", torch.masked_select(b["returns"], mask)))
    if use_critic and "values" in b:
        values = torch.masked_select(b["values"], mask)
        returns = torch.masked_select(b["returns"], mask)
        out.update(_stats("critic/values", values))
        var_returns = torch.var(returns)
        out["critic/vf_explained_var"] = 1.0 - torch.var(returns - values) / (var_returns + 1e-5)
    out.update(_stats("response_length", response_len))
    out["response_length/clip_ratio"] = (response_len >= max_resp).float().mean()
    out.update(_stats("response_length_non_aborted", response_len[kept]))
    out["response_length_non_aborted/clip_ratio"] = (response_len[kept] >= max_resp).float().mean() if kept.any() \
        else torch.zeros(())
    out["response/aborted_ratio"] = (~kept).float().mean()
    out.update(_stats("prompt_length", prompt_len))
    out["prompt_length/clip_ratio"] = (prompt_len >= max_prompt).float().mean()
    if "rollout_log_probs" in b and "old_log_probs" in b:
        out.update(rollout_mismatch_metrics(b["old_log_probs"], b["rollout_log_probs"], mask, tis_cap))
    return {k: float(v) for k, v in out.items()}


def compute_timing_metrics(batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
    """timing_s/<phase> and timing_per_token_ms/<phase> (per prompt+response token the phase touched)."""
    prompt_len, response_len, _, _ = _lengths(batch)
    num_prompt, num_response = float(prompt_len.sum()), float(response_len.sum())
    tokens = {"gen": num_response}
    all_tokens = num_prompt + num_response
    out = {f"timing_s/{k}": v for k, v in timing.items()}
    for name, value in timing.items():
        if name == "step":
            continue
        denom = tokens.get(name, all_tokens)
        if denom > 0:
            out[f"timing_per_token_ms/{name}"] = value * 1000.0 / denom
    return out


def compute_throughput_metrics(batch: DataProto, timing: dict[str, float], num_ranks: int) -> dict[str, float]:
    """perf/total_num_tokens, perf/time_per_step, perf/throughput (tokens per second per rank)."""
    total = float(batch.batch["attention_mask"].sum())
    step = timing.get("step", 0.0)
    out = {"perf/total_num_tokens": total, "perf/time_per_step": step}
    if step > 0:
        out["perf/throughput"] = total / (step * max(num_ranks, 1))
    gen = timing.get("gen", 0.0)
    if gen > 0:
        _, response_len, _, _ = _lengths(batch)
        out["perf/gen_tokens_per_s"] = float(response_len.sum()) / gen
    return out


# Peak dense bf16 TFLOPS by device name (a substring of torch.cuda.get_device_name()).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                    "A10": 125.0, "L4": 121.0, "4090": 165.0, "3090": 71.0}


def model_flops_per_token(hf_config, seq_len: float) -> float:
    """Training FLOPs per token at `seq_len`, by the model's family (tinyzero.models.families)."""
    from tinyzero.models.families import family_of

    return family_of(hf_config).flops_per_token(hf_config, seq_len)


def compute_mfu_metrics(batch: DataProto, timing: dict[str, float], hf_config, num_ranks: int, ppo_epochs: int,
                        device: torch.device) -> dict[str, float]:
    """perf/mfu/actor: model FLOPs of the actor update / (its time x the ranks' peak); GPU only."""
    seconds = timing.get("update_actor", 0.0)
    if device.type != "cuda" or hf_config is None or seconds <= 0:
        return {}
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in torch.cuda.get_device_name(device)), None)
    if peak is None:
        return {}
    tokens = batch.batch["attention_mask"].sum(-1).float()  # (rows,)
    flops = float(sum(model_flops_per_token(hf_config, float(t)) * float(t) for t in tokens)) * ppo_epochs
    return {"perf/mfu/actor": flops / (seconds * peak * 1e12 * max(num_ranks, 1))}


def max_memory_allocated_gb(device: torch.device) -> float:
    """Peak accelerator memory of this process (0 on CPU, where torch does not track it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return 0.0


def reduce_metrics(metrics: dict) -> dict[str, float]:
    """Lists of per-micro-batch / per-rank values -> their mean; scalars pass through."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (list, tuple, np.ndarray)):
            arr = np.asarray([float(v) for v in value], dtype=np.float64)
            out[key] = float(arr.mean()) if arr.size else 0.0
        elif isinstance(value, torch.Tensor):
            out[key] = float(value.float().mean())
        else:
            out[key] = float(value)
    return out


def merge_worker_metrics(outputs) -> dict[str, float]:
    """Metrics from a worker call: a DataProto (meta_info["metrics"]) or a list of them (one per worker)."""
    if isinstance(outputs, DataProto):
        outputs = [outputs]
    merged: dict[str, list] = {}
    for out in outputs:
        if out is None:
            continue
        for key, value in (out.meta_info.get("metrics", {}) if isinstance(out, DataProto) else out).items():
            merged.setdefault(key, []).extend(value if isinstance(value, (list, tuple)) else [value])
    return reduce_metrics(merged)
