"""The agent loop around the in-process vLLM engine (CPU): the same multi-turn loop as the native engine.

Greedy, same weights: the vLLM-driven loop gives the native-driven loop's responses, masks and stop
reasons, observation tokens included, and its rollout log-probs match the trainer's (HF fp32
forward) on the model's tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tinyzero.rollout.vllm.backend import vllm_available

_REASON = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(_REASON is not None, reason=f"needs vllm: {_REASON}")]

ENV_FILE = '''
class Again:
    def reset(self, row):
        return []

    def step(self, text):
        return "again: " + text[:5], 0.0, False
'''


def _worker(model_dir: str, env_spec: str):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_agent_loop import _prompts
    from tinyzero.agent import build_agent_engine
    from tinyzero.rollout import RolloutConfig

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    common = dict(response_length=40, prompt_length=24, dtype="fp32", max_num_seqs=16, seed=1,
                  multi_turn={"enable": True, "environment": env_spec, "max_turns": 4})
    results = {}
    for name in ("native", "vllm"):
        engine = build_agent_engine(RolloutConfig(name=name, **common), model_dir, tok, device="cpu",
                                    load_weights=True)
        engine.wake_up()
        batch = _prompts(tok, ["case-a", "case-bb", "case-ccc"])
        batch.meta_info.update(do_sample=False, stop_token_ids=list(range(3, 120)))
        out = engine.generate_sequences(batch)
        engine.shutdown()
        results[name] = {k: out.batch[k] for k in ("responses", "response_mask", "attention_mask",
                                                    "rollout_log_probs", "input_ids", "position_ids")}
        results[name]["stop_reason"] = list(out.non_tensor_batch["stop_reason"])
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    b = results["vllm"]
    with torch.no_grad():
        logits = trainer(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                         position_ids=b["position_ids"]).logits.double()
    R = b["responses"].shape[1]
    ref = torch.log_softmax(logits[:, -R - 1:-1], -1).gather(-1, b["responses"][..., None])[..., 0]
    m = b["response_mask"].bool()
    results["lp_max_abs_diff"] = float((ref[m] - b["rollout_log_probs"].double()[m]).abs().max())
    # Plain lists back to the parent (tensors would travel as shared-memory handles of an exited process).
    return {k: {kk: vv.tolist() if torch.is_tensor(vv) else vv for kk, vv in v.items()} if isinstance(v, dict) else v
            for k, v in results.items()}


def test_vllm_drives_the_same_loop(tmp_path_factory):
    from tinyzero.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("agent_vllm")
    build_tiny_model(str(root / "model"), seed=0, num_heads=2, num_kv_heads=1)  # vLLM CPU: head_dim 32
    (root / "env.py").write_text(ENV_FILE)
    (res,) = run_distributed(_worker, 1, str(root / "model"), f"{root}/env.py:Again", timeout=600)
    native, vllm = res["native"], res["vllm"]
    model, attended = torch.tensor(vllm["response_mask"]), torch.tensor(vllm["attention_mask"])[:, -40:]
    assert int((model == 0)[attended.bool()].sum()) > 0  # observations are in the responses
    for key in ("responses", "response_mask", "attention_mask"):
        assert native[key] == vllm[key], key
    assert native["stop_reason"] == vllm["stop_reason"]
    assert res["lp_max_abs_diff"] < 1e-3, res["lp_max_abs_diff"]


def _stop_worker(model_dir: str):
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from tests.test_agent_stop import run_tool_agent, tool_agent_config, tool_batch

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    keys = ("responses", "response_mask", "attention_mask", "rollout_log_probs")
    native = run_tool_agent(model_dir, "native")
    from tinyzero.agent import build_agent_engine

    agent = build_agent_engine(tool_agent_config("vllm"), model_dir, tok, device="cpu", load_weights=True)
    agent.wake_up()
    vllm = agent.generate_sequences(tool_batch(tok))
    results = {"native": {k: native.batch[k].tolist() for k in keys},
               "vllm": {k: vllm.batch[k].tolist() for k in keys},
               "reasons": [list(native.non_tensor_batch["stop_reason"]), list(vllm.non_tensor_batch["stop_reason"])]}
    # The engine alone: the tag as a stop sequence ends the greedy response right after it; sampled rows
    # with stop sequences are the free rows cut after the first occurrence (same seeds).
    engine = agent.inner
    tag = tok.encode("</tool_call>", add_special_tokens=False)
    results["tag"] = engine.generate_sequences(tool_batch(tok, stop_sequences=[tag])).batch["responses"][0].tolist()
    sampled = dict(do_sample=True, seed=3, eos_token_id=[], response_length=40)
    free = engine.generate_sequences(tool_batch(tok, ("case-a", "case-bb"), n=2, **sampled)).batch
    rows = free["responses"].tolist()
    sequences = [rows[0][8:11], rows[3][20:22]]
    stopped = engine.generate_sequences(tool_batch(tok, ("case-a", "case-bb"), n=2, stop_sequences=sequences,
                                                   **sampled)).batch
    results["free"] = {k: free[k].tolist() for k in keys}
    results["stopped"] = {k: stopped[k].tolist() for k in keys}
    results["sequences"] = sequences
    agent.shutdown()
    return results


def test_vllm_turn_ends_at_tool_call(tmp_path_factory):
    """The trained tool-call model: vLLM's loop stops each turn at </tool_call> as the native one does."""
    from tests.test_agent_stop import CALL, _reference_cut, build_tool_call_model

    model_dir = build_tool_call_model(str(tmp_path_factory.mktemp("agent_vllm_stop") / "model"))
    (res,) = run_distributed(_stop_worker, 1, model_dir, timeout=900)
    for key in ("responses", "response_mask", "attention_mask"):
        assert res["native"][key] == res["vllm"][key], key
    assert res["reasons"] == [["eos"], ["eos"]]
    m = torch.tensor(res["vllm"]["response_mask"]).bool()
    lp_native, lp_vllm = torch.tensor(res["native"]["rollout_log_probs"]), torch.tensor(res["vllm"]["rollout_log_probs"])
    assert float((lp_native[m] - lp_vllm[m]).abs().max()) < 1e-3
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    call = tok.encode(CALL, add_special_tokens=False)
    assert res["tag"][:len(call)] == call and set(res["tag"][len(call):]) == {tok.pad_token_id}
    R = 40
    for b, row in enumerate(res["free"]["responses"]):
        k = _reference_cut(row, set(), res["sequences"], R)
        assert res["stopped"]["response_mask"][b] == [1] * k + [0] * (R - k), b
        assert res["stopped"]["responses"][b][:k] == row[:k]
        torch.testing.assert_close(torch.tensor(res["stopped"]["rollout_log_probs"][b][:k]),
                                   torch.tensor(res["free"]["rollout_log_probs"][b][:k]), rtol=0, atol=1e-6)
