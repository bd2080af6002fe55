"""agent/* metrics of a multi-turn rollout, over every row of the batch they are given.

The agent loop (loop.py) records per-sample counters as non-tensor fields of its output (AGENT_FIELDS).
Those rows travel with the batch, so the driver computes the metrics on the batch gathered from every
data-parallel rank (trainer.loop.pop_metrics) and they describe the whole step, not one rank's share.

veRL's names come with them: num_turns/{min,max,mean} counts a conversation's messages as veRL's agent loop
does (the prompt, each assistant turn and each observation: a sample of t assistant turns got t - 1
observations, so 2 t), and tool_call_counts/{min,max,mean} the tool calls answered per sample.
"""

from __future__ import annotations

import numpy as np

STOP_REASONS = ("eos", "max_turns", "budget", "tool_error")
AGENT_FIELDS = ("stop_reason", "num_turns", "num_tool_calls", "num_tool_errors", "num_tool_timeouts",
                "num_observation_tokens")


def agent_metrics(non_tensor_batch: dict) -> dict[str, float]:
    """agent/* metrics over every row of a rollout's non_tensor_batch; {} when it lacks the agent fields
    (not a multi-turn rollout)."""
    if any(key not in non_tensor_batch for key in AGENT_FIELDS):
        return {}
    count = {key: np.asarray(non_tensor_batch[key], dtype=np.float64) for key in AGENT_FIELDS[1:]}
    reasons = [str(r) for r in non_tensor_batch["stop_reason"]]
    rows = max(len(reasons), 1)
    turns = count["num_turns"]
    metrics = {
        "agent/turns/mean": float(turns.sum()) / rows, "agent/turns/max": float(turns.max(initial=0.0)),
        "agent/tool_calls/mean": float(count["num_tool_calls"].sum()) / rows,
        "agent/tool_calls/total": float(count["num_tool_calls"].sum()),
        "agent/tool_errors/total": float(count["num_tool_errors"].sum()),
        "agent/tool_timeouts/total": float(count["num_tool_timeouts"].sum()),
        "agent/observation_tokens/mean": float(count["num_observation_tokens"].sum()) / rows,
    }
    for reason in STOP_REASONS:
        metrics[f"agent/stop_reason/{reason}"] = sum(r == reason for r in reasons) / rows
    for name, values in (("num_turns", 2 * turns), ("tool_call_counts", count["num_tool_calls"])):
        if values.size:
            metrics.update({f"{name}/min": float(values.min()), f"{name}/max": float(values.max()),
                            f"{name}/mean": float(values.mean())})
    return metrics
