"""The multi-turn loop (tinyzero.agent.loop.AgentRollout) around an engine.

Loop logic with a scripted inner engine (it answers each row from a script keyed on the prompt and
the turn, so tool calls happen on cue): the responses are the scripted tokens and the observation
tokens in order and equal the template's rendering of the whole conversation; response_mask is 1
exactly on the scripted tokens; rollout_log_probs are the engine's there and 0 on observations;
stop reasons, turn and tool counts, and the rows of each engine call. A turn ends right after its
tool call's closing tag (the scripted engine writes on past it, as an engine that ignores stop
sequences would; the loop keeps the tokens up to the tag), or at the stop token with
stop_at_tool_call off. Then the real native engine
on the tiny model through build_agent_engine (rollout.multi_turn.enable, an environment that always
answers): the actor's log-probs of the sampled tokens equal the engine's within 1e-4 (fp32).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
END = "<|im_end|>"
SCRIPTS = {
    "case-tool": ["Let me compute.\n" + CALL % "37*412" + END, "The answer is <answer>15244</answer>." + END],
    "case-loop": ["again " + CALL % "1+1" + END] * 5,
    "case-long": ["x" * 1000],
    "case-malformed": ['<tool_call>{"name": "calculator", "arguments": {</tool_call>' + END, "Sorry." + END],
    "case-badexpr": [CALL % "2 ** 10" + END, "I cannot." + END],
    "case-direct": ["It is 4." + END],
    "case-env": ["5" + END, "8" + END, "7" + END],
}


class ScriptedEngine:
    """An inner engine whose rows answer SCRIPTS[key][turn] (turn = assistant turns in the context so far)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.calls: list[tuple[int, int]] = []  # (rows, response_length) per generate call
        self.stop_sequences: list = []  # meta_info["stop_sequences"] of each call

    def generate_sequences(self, prompts):
        from tinyzero.rollout.outputs import build_output

        ids, mask, pos = (prompts.batch[k] for k in ("input_ids", "attention_mask", "position_ids"))
        R = int(prompts.meta_info["response_length"])
        assert prompts.meta_info["n"] == 1
        self.calls.append((ids.shape[0], R))
        self.stop_sequences.append(prompts.meta_info.get("stop_sequences"))
        responses = torch.zeros(ids.shape[0], R, dtype=torch.long)
        rmask = torch.zeros_like(responses)
        lps = torch.zeros(ids.shape[0], R)
        for r in range(ids.shape[0]):
            text = self.tok.decode(ids[r][mask[r].bool()])
            key = next(k for k in SCRIPTS if k in text)
            turn = text.count("<|im_start|>assistant") - 1
            toks = self.tok.encode(SCRIPTS[key][turn], add_special_tokens=False)[:R]
            responses[r, :len(toks)] = torch.tensor(toks)
            rmask[r, :len(toks)] = 1
            lps[r, :len(toks)] = -0.001 * torch.arange(1, len(toks) + 1) - turn
        # Positions must continue the context's: the loop passes them in.
        assert torch.equal(pos[mask.bool()], torch.cat([torch.arange(int(m.sum())) for m in mask]))
        return build_output(ids, mask, pos, responses, rmask, lps, meta_info={"temperature": 1.0})

    def update_weights(self, named_tensors):
        return 0

    def sleep(self):
        pass

    def wake_up(self, tags=None):
        pass

    def shutdown(self):
        pass

    def memory_metrics(self):
        return {}


def _prompts(tok, keys, n=1):
    from tinyzero.data.rl_dataset import compute_position_ids, left_pad
    from tinyzero.protocol import DataProto

    texts = [tok.apply_chat_template([{"role": "user", "content": k}], add_generation_prompt=True, tokenize=False)
             for k in keys]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, ids))
    rows = [left_pad(x, width, tok.pad_token_id) for x in ids]
    input_ids, mask = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask,
                                "position_ids": compute_position_ids(mask)},
                               non_tensors={"index": np.arange(len(keys))},
                               meta_info={"pad_token_id": tok.pad_token_id, "n": n,
                                          "eos_token_id": [tok.convert_tokens_to_ids(END)]})


def _agent(tok, response_length=512, **multi_turn):
    from tinyzero.agent.loop import AgentRollout
    from tinyzero.rollout.config import RolloutConfig

    cfg = RolloutConfig(response_length=response_length, multi_turn={"enable": True, **multi_turn})
    return AgentRollout(ScriptedEngine(tok), cfg, tok)


def _expected_response(tok, key, turns, observations):
    """The template's rendering of the whole conversation after the prompt (reference), as ids."""
    user = [{"role": "user", "content": key}]
    conv = list(user)
    for i, reply in enumerate(turns):
        conv.append({"role": "assistant", "content": reply.removesuffix(END)})
        if i < len(observations):
            conv += observations[i]
    whole = tok.apply_chat_template(conv, tokenize=False)
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    text = whole[len(prompt):].removesuffix("\n")
    if not _cut(turns[-1]).endswith(END):  # the last turn ended at its tool call: no end token sampled
        text = text.removesuffix(END)
    return tok.encode(text, add_special_tokens=False)


def _cut(reply: str) -> str:
    """A scripted turn as the loop keeps it: up to the first tool call's closing tag."""
    at = reply.find("</tool_call>")
    return reply if at < 0 else reply[:at + len("</tool_call>")]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_loop_with_tools(tok):
    keys = ["case-tool", "case-loop", "case-long", "case-malformed", "case-badexpr", "case-direct"]
    from tinyzero.rollout import RolloutEngine

    agent = _agent(tok, tools=["calculator"], max_turns=3)
    assert isinstance(agent, RolloutEngine)
    try:
        out = agent.generate_sequences(_prompts(tok, keys))
    finally:
        agent.shutdown()
    b = out.batch
    R = 512
    assert b["responses"].shape == (6, R) and b["input_ids"].shape[1] == b["prompts"].shape[1] + R
    assert list(out.non_tensor_batch["stop_reason"]) == ["eos", "max_turns", "budget", "eos", "eos", "eos"]
    assert list(out.non_tensor_batch["num_turns"]) == [2, 3, 1, 2, 2, 1]
    assert list(out.non_tensor_batch["num_tool_calls"]) == [1, 2, 0, 1, 1, 0]
    assert list(out.non_tensor_batch["index"]) == list(range(6))  # the prompt batch's fields carried through
    tool = [{"role": "tool", "content": "15244"}]
    two = [{"role": "tool", "content": "2"}]
    expected = {
        0: (SCRIPTS["case-tool"], [tool]),
        1: (SCRIPTS["case-loop"][:3], [two, two]),
        3: (SCRIPTS["case-malformed"], None),
        4: (SCRIPTS["case-badexpr"], None),
        5: (SCRIPTS["case-direct"], []),
    }
    for i, (turns, observations) in expected.items():
        length = int(b["attention_mask"][i, -R:].sum())
        got = b["responses"][i, :length].tolist()
        if observations is None:  # error text comes from the parser / the tool worker: check its shape
            text = tok.decode(got)
            assert "<|im_start|>tool\ntool error: " in text, text
            assert ("not valid JSON" if i == 3 else "ValueError: cannot evaluate '2 ** 10'") in text
        else:
            assert got == _expected_response(tok, keys[i], turns, observations), tok.decode(got)
        # response_mask is 1 exactly on the scripted tokens up to each turn's tool-call tag, in order;
        # log-probs are the engine's there.
        model = b["response_mask"][i, :length].bool()
        sampled = [tok.encode(_cut(t), add_special_tokens=False) for t in turns]
        assert b["responses"][i, :length][model].tolist() == sum(sampled, [])
        want_lp = torch.cat([-0.001 * torch.arange(1, len(s) + 1) - t for t, s in enumerate(sampled)])
        torch.testing.assert_close(b["rollout_log_probs"][i, :length][model], want_lp.float(), rtol=0, atol=1e-6)
        assert not b["rollout_log_probs"][i, :length][~model].any()
        assert (b["attention_mask"][i, -R:][:length] == 1).all() and not b["attention_mask"][i, -R:][length:].any()
        assert not b["response_mask"][i, length:].any()
    # The budget case: 1000 scripted tokens cut at the response length, all model tokens.
    assert int(b["response_mask"][2].sum()) == R == int(b["attention_mask"][2, -R:].sum())
    # Positions continue through observations; every engine call took the active rows only.
    pos = b["position_ids"]
    assert torch.equal(pos[:, -R:], pos[:, -R - 1:-R] + torch.arange(1, R + 1))
    assert [rows for rows, _ in agent.inner.calls] == [6, 4, 1]
    tag = tok.encode("</tool_call>", add_special_tokens=False)
    assert agent.inner.stop_sequences == [[tag]] * 3  # the engine was asked to stop after the tag
    from tinyzero.agent.metrics import agent_metrics

    assert "metrics" not in out.meta_info  # the driver computes agent/* from the rows (every rank's)
    m = agent_metrics(out.non_tensor_batch)
    assert m["agent/turns/max"] == 3 and m["agent/tool_calls/total"] == 5 and m["agent/tool_errors/total"] == 2
    assert m["agent/stop_reason/eos"] == pytest.approx(4 / 6) and m["agent/stop_reason/budget"] == pytest.approx(1 / 6)
    assert m["agent/observation_tokens/mean"] > 0 and m["agent/tool_timeouts/total"] == 0
    # The reward manager decodes the whole multi-turn response (observations included) and puts the
    # score on the last token, a model token.
    from tinyzero.rewards import RewardManager

    out.non_tensor_batch["data_source"] = np.array(["arithmetic"] * 6, dtype=object)
    out.non_tensor_batch["reward_model"] = np.array([{"style": "rule", "ground_truth": "15244"}] * 6, dtype=object)
    scored = RewardManager(tok)(out)
    assert scored.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    last = int(b["attention_mask"][0, -R:].sum()) - 1
    assert scored.token_level_scores[0, last] == 1.0 and b["response_mask"][0, last] == 1
    assert "tool\n15244\n" in scored.samples[0]["response"]  # the observation is part of the decoded text


def test_stop_on_tool_error_and_budget(tok):
    agent = _agent(tok, tools=["calculator"], stop_on_tool_error=True)
    out = agent.generate_sequences(_prompts(tok, ["case-badexpr", "case-tool"], n=2))
    agent.shutdown()
    assert list(out.non_tensor_batch["stop_reason"]) == ["tool_error"] * 2 + ["eos"] * 2
    assert torch.equal(out.batch["responses"][0], out.batch["responses"][1])  # rows of one prompt adjacent
    # A budget that ends inside the observation: the observation is not appended, the sample ends.
    first = len(tok.encode(_cut(SCRIPTS["case-tool"][0]), add_special_tokens=False))
    agent = _agent(tok, response_length=first + 5, tools=["calculator"])
    out = agent.generate_sequences(_prompts(tok, ["case-tool"]))
    agent.shutdown()
    assert list(out.non_tensor_batch["stop_reason"]) == ["budget"]
    assert int(out.batch["attention_mask"][0, -(first + 5):].sum()) == first == int(out.batch["response_mask"].sum())


ENV_FILE = '''
class Guess:
    """Answer higher / lower until the model says 7; the reset replaces the prompt when asked to."""

    def reset(self, row):
        self.row = row
        if row["index"] == 1:
            return [{"role": "system", "content": "Game."}, {"role": "user", "content": "case-env again"}]
        return []

    def step(self, text):
        if text.strip() == "7":
            return None, 1.0, True
        return ("higher" if int(text) < 7 else "lower"), -0.25, False
'''


def test_environment(tok, tmp_path):
    path = tmp_path / "env.py"
    path.write_text(textwrap.dedent(ENV_FILE))
    agent = _agent(tok, environment=f"{path}:Guess", max_turns=4)
    prompts = _prompts(tok, ["case-env", "case-env"])
    # An object array of lists, as the dataset's collate makes (the None keeps numpy from stacking them).
    prompts.non_tensor_batch["raw_prompt_ids"] = np.array(
        [ids[m.bool()].tolist() for ids, m in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"])]
        + [None], dtype=object)[:2]
    out = agent.generate_sequences(prompts)
    assert list(out.non_tensor_batch["stop_reason"]) == ["eos", "eos"]
    assert list(out.non_tensor_batch["env_reward"]) == [0.5, 0.5]
    turns = SCRIPTS["case-env"]
    obs = [[{"role": "user", "content": "higher"}], [{"role": "user", "content": "lower"}]]
    length = int(out.batch["attention_mask"][0, -512:].sum())
    assert out.batch["responses"][0, :length].tolist() == _expected_response(tok, "case-env", turns, obs)
    # Row 1's environment replaced its prompt: the output's prompt is the reset conversation.
    prompt = out.batch["prompts"][1][out.batch["attention_mask"][1, :out.batch["prompts"].shape[1]].bool()]
    msgs = [{"role": "system", "content": "Game."}, {"role": "user", "content": "case-env again"}]
    assert tok.decode(prompt) == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out.non_tensor_batch["raw_prompt_ids"][1] == prompt.tolist()
    assert out.non_tensor_batch["raw_prompt_ids"][0] == prompts.non_tensor_batch["raw_prompt_ids"][0]
    assert torch.equal(out.batch["responses"][0], out.batch["responses"][1])


ALWAYS_FILE = '''
class Again:
    def reset(self, row):
        return []

    def step(self, text):
        return "again: " + text[:5], 0.0, False
'''


def test_native_engine_log_probs_match_actor(tiny_model_dir, tmp_path, tok):
    """The real native engine in the loop: actor log-probs of the sampled tokens == rollout's (1e-4, fp32)."""
    from transformers import AutoModelForCausalLM

    from tinyzero.agent import build_agent_engine
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.workers.actor import PPOActor
    from tinyzero.workers.config import ActorConfig
    from tinyzero.workers.forward import attach_log_prob_method

    torch.manual_seed(0)
    path = tmp_path / "again.py"
    path.write_text(ALWAYS_FILE)
    R = 40
    cfg = RolloutConfig(name="native", response_length=R, prompt_length=32, dtype="fp32",
                        multi_turn={"enable": True, "environment": f"{path}:Again", "max_turns": 4})
    engine = build_agent_engine(cfg, tiny_model_dir, tok, device="cpu", load_weights=True)
    prompts = _prompts(tok, ["case-a", "case-bb", "case-ccc"], n=2)
    # Many stop ids, so the random tiny model ends its turns within a few tokens.
    prompts.meta_info.update(stop_token_ids=list(range(3, 120)), seed=11)
    out = engine.generate_sequences(prompts)
    engine.shutdown()
    b = out.batch
    assert int((b["response_mask"] == 0)[b["attention_mask"][:, -R:].bool()].sum()) > 0  # observations exist
    assert set(out.non_tensor_batch["stop_reason"]) <= {"max_turns", "budget", "eos"}
    assert max(out.non_tensor_batch["num_turns"]) > 1
    model = attach_log_prob_method(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    mask = b["response_mask"].bool()
    for packing in ("none", "remove_padding"):  # padded rows, and packed rows with observations attended
        actor = PPOActor(ActorConfig(), model, dp_group=None, dp_size=1, device="cpu", packing=packing)
        log_probs, _ = actor.compute_log_prob(out, 4, False, 4096, float(out.meta_info.get("temperature", 1.0)))
        torch.testing.assert_close(log_probs[mask], b["rollout_log_probs"][mask], rtol=0, atol=1e-4)
    assert not b["rollout_log_probs"][~mask].any()


def test_turn_goes_on_past_the_call_without_stop_at_tool_call(tok):
    agent = _agent(tok, tools=["calculator"], stop_at_tool_call=False)
    out = agent.generate_sequences(_prompts(tok, ["case-tool"]))
    agent.shutdown()
    assert agent.inner.stop_sequences == [None, None]  # no stop sequence asked of the engine
    sampled = sum((tok.encode(t, add_special_tokens=False) for t in SCRIPTS["case-tool"]), [])
    b = out.batch
    assert b["responses"][0][b["response_mask"][0].bool()].tolist() == sampled  # <|im_end|> after the call too
    assert list(out.non_tensor_batch["num_tool_calls"]) == [1]
