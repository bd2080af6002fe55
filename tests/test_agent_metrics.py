"""agent/* metrics cover every data-parallel rank's rows, not the first rank's share.

Two gloo ranks each run the agent loop (around the scripted engine of test_agent_loop) on their half of
the batch through a WorkerGroup (DP_COMPUTE_PROTO, the dispatch the actor worker's generate_sequences
uses); the driver's metrics (trainer.loop.pop_metrics) equal those a plain loop computes over the
whole gathered batch, and differ from the first rank's half alone.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tinyzero.single_controller import Dispatch, Worker, register

# Rank 0's half answers at once or after one good call; rank 1's half loops or makes failing calls.
KEYS = ["case-tool", "case-direct", "case-direct", "case-loop", "case-badexpr", "case-malformed"]


class ScriptedAgentWorker(Worker):
    """The agent loop around the scripted engine, as a worker role."""

    def __init__(self, model_dir: str):
        super().__init__()
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts):
        from tests.test_agent_loop import _agent

        agent = _agent(self.tok, response_length=512, tools=["calculator"], max_turns=3, num_tool_workers=1)
        try:
            return agent.generate_sequences(prompts)
        finally:
            agent.shutdown()


def _worker(model_dir: str):
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from tests.test_agent_loop import _prompts
    from tinyzero.agent.metrics import agent_metrics
    from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from tinyzero.trainer.loop import pop_metrics

    dist.init_process_group("gloo")
    tok = AutoTokenizer.from_pretrained(model_dir)
    wg = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=ClassWithInitArgs(ScriptedAgentWorker, model_dir))
    gen = wg.generate_sequences(_prompts(tok, KEYS))
    metrics = pop_metrics(gen)
    # The reference: a plain loop over every gathered row; observation tokens counted from the masks.
    rows = len(gen)
    nt = gen.non_tensor_batch
    R = gen.batch["responses"].shape[1]
    observation = [sum(1 for a, m in zip(gen.batch["attention_mask"][i, -R:].tolist(),
                                         gen.batch["response_mask"][i].tolist()) if a == 1 and m == 0)
                   for i in range(rows)]
    ref = {
        "agent/turns/mean": sum(nt["num_turns"]) / rows, "agent/turns/max": float(max(nt["num_turns"])),
        "agent/tool_calls/mean": sum(nt["num_tool_calls"]) / rows,
        "agent/tool_calls/total": float(sum(nt["num_tool_calls"])),
        "agent/tool_errors/total": float(sum(nt["num_tool_errors"])),
        "agent/tool_timeouts/total": float(sum(nt["num_tool_timeouts"])),
        "agent/observation_tokens/mean": sum(observation) / rows,
    }
    for reason in ("eos", "max_turns", "budget", "tool_error"):
        ref[f"agent/stop_reason/{reason}"] = sum(1 for r in nt["stop_reason"] if r == reason) / rows
    # veRL's num_turns: the prompt + assistant turns + observations (runs of attended, unmasked tokens).
    segments = []
    for i in range(rows):
        kinds = [m for a, m in zip(gen.batch["attention_mask"][i, -R:].tolist(), gen.batch["response_mask"][i].tolist())
                 if a == 1]
        segments.append(sum(1 for j, m in enumerate(kinds) if m == 0 and (j == 0 or kinds[j - 1] == 1)))
    messages = [1 + int(t) + o for t, o in zip(nt["num_turns"], segments)]
    calls = [int(c) for c in nt["num_tool_calls"]]
    ref.update({"num_turns/min": float(min(messages)), "num_turns/max": float(max(messages)),
                "num_turns/mean": sum(messages) / rows, "tool_call_counts/min": float(min(calls)),
                "tool_call_counts/max": float(max(calls)), "tool_call_counts/mean": sum(calls) / rows})
    first_half = agent_metrics({k: v[: rows // 2] for k, v in nt.items()})
    return rows, list(nt["num_turns"]), {k: metrics[k] for k in ref}, ref, first_half


@pytest.mark.slow
def test_agent_metrics_over_all_ranks(tiny_model_dir):
    results = run_distributed(_worker, 2, tiny_model_dir, timeout=300)
    for rows, turns, metrics, ref, first_half in results:
        assert rows == len(KEYS)
        assert turns == [2, 1, 1, 3, 2, 2]  # both halves are in the gathered batch, in order
        assert metrics.keys() == ref.keys()
        for key, value in ref.items():
            assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
        assert metrics["agent/tool_errors/total"] == 2 and metrics["agent/tool_calls/total"] == 5
        assert metrics["agent/stop_reason/max_turns"] == pytest.approx(1 / 6)
        # The first rank's half alone would say otherwise.
        assert first_half["agent/tool_errors/total"] == 0 and first_half["agent/turns/max"] == 2
    assert results[0][2] == results[1][2]  # every rank logs the same
