"""The tools demo (`python -m tinyzero.demo --task tools`): multi-turn GRPO with a calculator on 2 CPU ranks.

* The warm-up's conversations are token-exact with what the agent loop builds: SFTDataset's ids of a
  conversation equal the prompt's ids, the call's, the observation tokens the loop appends
  (agent.chat.ObservationRenderer) and the answer's, and its loss mask covers exactly the call and the
  answer, each with the template's "<|im_end|>\n" (tokens the loop never samples: harmless targets).
* End to end (slow, 6-7 min on a 2-core AVX2 machine): the tiny model, the warm-up (40% of the
  conversations call the calculator and copy its result, the others copy the question's larger factor
  as a guess) and GRPO with the calculator in the agent loop. Greedy validation (through the agent loop) of the warmed-up policy
  mostly guesses: accuracy at most 0.3. GRPO teaches it to call the tool: accuracy rises by at least
  0.3 and tool calls per validation sample end above 0.9 (val/agent/tool_calls/mean); the trained
  policy with the calculator disabled (one assistant turn) stays below 0.05. Measured: --seed 0 (the
  test's) 0.00 -> 0.86 (0.89 with the packed warm-up), --seed 1 0.00 -> 0.91, --seed 2 0.00 -> 1.00.
"""

from __future__ import annotations

import pytest

from tinyzero.demo_tools import DATA_SOURCE, conversation, tool_call


def test_warmup_conversations_match_the_agent_loop_tokens(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from tinyzero.agent.chat import ObservationRenderer
    from tinyzero.data.config import DataConfig
    from tinyzero.data.preprocess.common import write_parquet
    from tinyzero.data.sft_dataset import SFTDataset

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    problems = [(23, 456, 23 * 456 + 1), (10, 100, 1002), (99, 999, 99 * 999 + 2)]
    write_parquet([{"messages": conversation(a, b, answer)} for a, b, answer in problems], str(tmp_path / "s.parquet"))
    data = SFTDataset([str(tmp_path / "s.parquet")], tok, DataConfig(messages_key="messages", max_length=160))
    renderer = ObservationRenderer(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for (a, b, answer), item in zip(problems, (data[i] for i in range(len(problems)))):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"{a}*{b}="}],
                                                    add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
        call = tok.encode(tool_call(a, b), add_special_tokens=False)
        # The loop's turn ends right after the call's last sampled token (not a stop token).
        observation = renderer.observation_ids([{"role": "tool", "content": str(a * b)}], call[-1])
        reply = tok.encode(f"<answer>{answer}</answer>", add_special_tokens=False) + [end]
        loop_ids = prompt + call + observation + reply
        n = int(item["attention_mask"].sum())
        ids, mask = item["input_ids"][:n].tolist(), item["loss_mask"][:n].tolist()
        assert ids[:len(loop_ids)] == loop_ids and tok.decode(ids[len(loop_ids):]) == "\n"  # the template's last "\n"
        # Trained on: the call and the answer, each with the template's "<|im_end|>\n" (the loop never samples
        # the call's: its stop sequence ends the turn at the tag; nor the "\n"s: <|im_end|> stops it).
        first = len(prompt) + len(call)
        assert mask[:len(prompt)] == [0] * len(prompt)
        assert mask[len(prompt):first + 2] == [1] * (len(call) + 2) and ids[first] == end
        assert mask[first + 2:first + len(observation)] == [0] * (len(observation) - 2)
        assert mask[first + len(observation):] == [1] * (len(reply) + 1)
    assert DATA_SOURCE == "arithmetic"


@pytest.mark.slow
def test_tools_demo_learns_to_use_the_calculator(tmp_path):
    from tinyzero.demo import main, summary
    from tinyzero.trainer.loggers import read_metrics
    from tinyzero.trainer.val_metrics import core_mean

    out = tmp_path / "demo_tools"
    assert main(["--task", "tools", "--out", str(out)]) == 0
    before, after = summary(str(out / "grpo"))
    acc_before, acc_after = core_mean(before, DATA_SOURCE), core_mean(after, DATA_SOURCE)
    assert acc_before <= 0.3, before  # the warm-up taught the format and the copying, not the products
    assert acc_after - acc_before >= 0.3, (before, after)
    assert after["val-aux/agent/tool_calls/mean"] > 0.9, after
    assert any("agent/tool_calls/mean" in row for row in read_metrics(str(out / "grpo")))  # training steps too
    no_tools = [r for r in read_metrics(str(out / "no_tools")) if core_mean(r, DATA_SOURCE) is not None]
    assert len(no_tools) == 1 and core_mean(no_tools[0], DATA_SOURCE) < 0.05, no_tools
    assert "val-aux/agent/tool_calls/mean" not in no_tools[0]  # one assistant turn, no agent loop
