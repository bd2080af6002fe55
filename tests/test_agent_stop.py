"""A turn ends at the end of a tool call: stop sequences in the native engine and in the agent loop.

* `finish_responses` / `stop_hits` with stop ids and multi-token stop sequences against a plain
  Python loop, on random tokens.
* The native engine with a stop sequence gives the tokens of the same call without it, cut right
  after the sequence's first occurrence (same seed: the sampler's noise is drawn per step up front).
* A tiny model trained here to write a calculator call and then go on past the closing tag
  ("... </tool_call> I guess 41"), and to answer "It is 42." after the tool's result: in the agent
  loop the turn stops right after `</tool_call>` (the tag is sampled, response_mask 1), the
  calculator's observation follows, and the next turn answers; without stop_at_tool_call the model
  writes on past the tag. The actor's log-probs of the sampled tokens equal the engine's (1e-4, fp32).
"""

from __future__ import annotations

import pytest
import torch

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
AFTER_CALL = " I guess 41"  # what the trained model writes after the tag when nothing stops it
ANSWER = "It is 42."
USER = [{"role": "user", "content": "case-stop"}]


def _reference_cut(tokens: list[int], stop_ids: set, sequences: list[list[int]], length: int) -> int:
    """Tokens kept by a plain loop: up to the first stop id or stop-sequence end within `length`."""
    for t in range(length):
        if tokens[t] in stop_ids or any(t + 1 >= len(s) and tokens[t + 1 - len(s):t + 1] == s for s in sequences):
            return t + 1
    return length


def test_finish_responses_with_stop_sequences_matches_loop():
    from tinyzero.rollout.generate import finish_responses

    g = torch.Generator().manual_seed(0)
    B, R = 64, 24
    tokens = torch.randint(0, 6, (B, R), generator=g)  # a small vocabulary: many (partial) matches
    log_probs = -torch.rand(B, R, generator=g)
    lengths = torch.randint(0, R + 1, (B,), generator=g)
    sequences = [[1, 2, 3], [4, 4], [5, 0, 5, 0]]
    stop_ids = [2]
    for ids, seqs in (([], sequences), (stop_ids, sequences), (stop_ids, [])):
        responses, mask, lps = finish_responses(tokens, log_probs, torch.tensor(ids, dtype=torch.long), lengths,
                                                pad_token_id=-1, stop_sequences=seqs)
        for b in range(B):
            k = _reference_cut(tokens[b].tolist(), set(ids), seqs, int(lengths[b]))
            assert mask[b].tolist() == [1] * k + [0] * (R - k), (b, ids, seqs)
            assert responses[b].tolist() == tokens[b, :k].tolist() + [-1] * (R - k)
            assert torch.equal(lps[b], torch.cat([log_probs[b, :k], torch.zeros(R - k)]))


def test_native_engine_stops_after_sequence(tiny_model_dir):
    from transformers import AutoTokenizer

    from tests.test_agent_loop import _prompts
    from tinyzero.rollout import RolloutConfig, build_rollout

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    R = 48
    engine = build_rollout(RolloutConfig(name="native", response_length=R, prompt_length=32, dtype="fp32"),
                           tiny_model_dir, tok, device="cpu", load_weights=True)

    def run(**meta):
        batch = _prompts(tok, ["case-a", "case-bb", "case-ccc"], n=2)
        batch.meta_info.update(seed=5, eos_token_id=[], **meta)
        return engine.generate_sequences(batch).batch

    free = run()
    assert bool(free["response_mask"].all())  # no stop at all: every row runs to R tokens
    # Stop sequences that occur in the free run (a 3-token and a 2-token window of two rows) and one
    # that never does; the stopped run is the free run cut after the first occurrence.
    rows = free["responses"].tolist()
    sequences = [rows[0][10:13], rows[3][30:32], [tok.pad_token_id] * 3]
    stopped = run(stop_sequences=sequences)
    engine.shutdown()
    for b, row in enumerate(rows):
        k = _reference_cut(row, set(), sequences, R)
        assert stopped["response_mask"][b].tolist() == [1] * k + [0] * (R - k), b
        assert stopped["responses"][b, :k].tolist() == row[:k]
        torch.testing.assert_close(stopped["rollout_log_probs"][b, :k], free["rollout_log_probs"][b, :k],
                                   rtol=0, atol=0)
    assert int(stopped["response_mask"][0].sum()) <= 13 and int(stopped["response_mask"][3].sum()) <= 32


def _encode_turns(tok, conv: list[dict], train_from: int) -> tuple[list[int], list[int]]:
    """Ids of a chat and labels on the content and end token of its assistant turns from `train_from` on."""
    head = len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
    ids, labels = [], []
    for k in range(len(conv)):
        before = tok.apply_chat_template(conv[:k], tokenize=False) if k else ""
        piece = tok.encode(tok.apply_chat_template(conv[:k + 1], tokenize=False)[len(before):],
                           add_special_tokens=False)
        ids += piece
        if conv[k]["role"] == "assistant" and k >= train_from:
            labels += [-100] * head + piece[head:-1] + [-100]  # content and <|im_end|>, not the "\n"
        else:
            labels += [-100] * len(piece)
    return ids, labels


def build_tool_call_model(out_dir: str, steps: int = 400) -> str:
    """The tiny model (head_dim 32, as vLLM's CPU backend needs) trained to answer USER with CALL + AFTER_CALL,
    and with ANSWER once the calculator's result follows the call. Greedy decoding reproduces both (checked)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinyzero.models.tiny import build_tiny_model

    build_tiny_model(out_dir, seed=0, num_heads=2, num_kv_heads=1)
    tok = AutoTokenizer.from_pretrained(out_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    chats = [_encode_turns(tok, USER + [{"role": "assistant", "content": CALL + AFTER_CALL}], 1),
             _encode_turns(tok, USER + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"},
                                        {"role": "assistant", "content": ANSWER}], 3)]
    width = max(len(ids) for ids, _ in chats)
    ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in chats])
    labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in chats])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in chats])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    after_tool = prompt + CALL + "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    for context, want in ((prompt, CALL + AFTER_CALL + "<|im_end|>"), (after_tool, ANSWER + "<|im_end|>")):
        x = torch.tensor([tok.encode(context, add_special_tokens=False)])
        got = tok.decode(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=len(want) + 4,
                                        do_sample=False, pad_token_id=tok.pad_token_id)[0, x.shape[1]:])
        assert got.startswith(want), f"the trained tiny model writes {got!r}, not {want!r} (loss {float(loss):.4f})"
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tool_call_model(str(tmp_path_factory.mktemp("tool_call_model")))


def tool_agent_config(name: str, stop_at_tool_call: bool = True):
    """A greedy-ready multi-turn rollout config with the calculator tool on engine `name`."""
    from tinyzero.rollout import RolloutConfig

    return RolloutConfig(name=name, response_length=160, prompt_length=32, dtype="fp32", max_num_seqs=8, seed=1,
                         multi_turn={"enable": True, "tools": ["calculator"], "max_turns": 3,
                                     "stop_at_tool_call": stop_at_tool_call, "num_tool_workers": 1})


def tool_batch(tok, keys=("case-stop",), n: int = 1, **meta):
    """Prompts of USER-style chats; greedy unless meta says otherwise."""
    from tests.test_agent_loop import _prompts

    batch = _prompts(tok, list(keys), n=n)
    batch.meta_info.update({"do_sample": False, **meta})
    return batch


def run_tool_agent(model_dir: str, name: str, stop_at_tool_call: bool = True):
    """One greedy multi-turn rollout of USER with the calculator tool on engine `name`."""
    from transformers import AutoTokenizer

    from tinyzero.agent import build_agent_engine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = build_agent_engine(tool_agent_config(name, stop_at_tool_call), model_dir, tok, device="cpu",
                                load_weights=True)
    engine.wake_up()
    try:
        return engine.generate_sequences(tool_batch(tok))
    finally:
        engine.shutdown()


def expected_rollout(tok) -> tuple[list[int], list[int]]:
    """The template's rendering of the whole tool conversation after the prompt, and its model-token mask."""
    conv = USER + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"},
                   {"role": "assistant", "content": ANSWER}]
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    whole = tok.apply_chat_template(conv, tokenize=False)[len(prompt):].removesuffix("\n")
    call = tok.encode(CALL, add_special_tokens=False)
    answer = tok.encode(ANSWER + "<|im_end|>", add_special_tokens=False)
    ids = tok.encode(whole, add_special_tokens=False)
    observation = len(ids) - len(call) - len(answer)
    return ids, [1] * len(call) + [0] * observation + [1] * len(answer)


@pytest.mark.slow
def test_turn_ends_at_tool_call_native(tool_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinyzero.workers.actor import PPOActor
    from tinyzero.workers.config import ActorConfig
    from tinyzero.workers.forward import attach_log_prob_method

    tok = AutoTokenizer.from_pretrained(tool_model)
    out = run_tool_agent(tool_model, "native")
    b, R = out.batch, 160
    ids, model = expected_rollout(tok)
    length = int(b["attention_mask"][0, -R:].sum())
    assert b["responses"][0, :length].tolist() == ids, tok.decode(b["responses"][0, :length])
    assert b["response_mask"][0, :length].tolist() == model  # the tag is sampled; <|im_end|> after it is not
    assert list(out.non_tensor_batch["stop_reason"]) == ["eos"]
    assert list(out.non_tensor_batch["num_turns"]) == [2] and list(out.non_tensor_batch["num_tool_calls"]) == [1]
    assert list(out.non_tensor_batch["num_tool_errors"]) == [0]
    hf = attach_log_prob_method(AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32))
    actor = PPOActor(ActorConfig(), hf, dp_group=None, dp_size=1, device="cpu")
    log_probs, _ = actor.compute_log_prob(out, 4, False, 4096, float(out.meta_info.get("temperature", 1.0)))
    mask = b["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], b["rollout_log_probs"][mask], rtol=0, atol=1e-4)

    # Without the stop the same model writes on past its call in the same turn.
    free = run_tool_agent(tool_model, "native", stop_at_tool_call=False)
    first = free.batch["responses"][0][: int(free.batch["response_mask"][0].tolist().index(0))]
    assert tok.decode(first) == CALL + AFTER_CALL + "<|im_end|>"


def test_stop_sequences_in_sampling_params():
    from tinyzero.rollout import RolloutConfig
    from tinyzero.rollout.engine import resolve_sampling_params

    meta = {"pad_token_id": 0, "eos_token_id": 7, "stop_sequences": [[5], [1, 2], [1, 2], [3, 4, 5]]}
    params = resolve_sampling_params(RolloutConfig(), meta, seed=0)
    assert params.stop_token_ids == [5, 7] and params.stop_sequences == [[1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="stop_sequences"):
        resolve_sampling_params(RolloutConfig(), {**meta, "stop_sequences": [[]]}, seed=0)
