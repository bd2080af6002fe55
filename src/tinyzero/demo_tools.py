"""The tools task of the CPU demo: the tiny model learns to use a calculator for 2-digit x 3-digit products.

    python -m tinyzero.demo --task tools [--out runs/demo_tools] [--nproc 2] [--steps N] [--seed S]

A prompt is "23*456=" (a user turn of the chat template). The tiny model cannot multiply, but
it can call the calculator tool in the agent loop (actor_rollout_ref.rollout.multi_turn):

    <|im_start|>assistant\\n<tool_call>{"name": "calculator", "arguments": {"expression": "23*456"}}</tool_call>
    <|im_end|>\\n<|im_start|>tool\\n10488<|im_end|>\\n<|im_start|>assistant\\n      (observation tokens)
    <answer>10488</answer><|im_end|>

scored by the arithmetic rule (the last <answer>N</answer> of the response: 1.0 right, 0.1 another
number, 0 none).

  1. SFT warm-up (`train.py sft --preset demo_cpu_tools_sft`) on conversations of other problems:
     CALL_SHARE of them call the calculator with the question's expression and answer the tool's
     result; the others answer at once with the question's larger factor, copied (a lazy guess,
     `warmup_conversation`). It teaches the tool-call format and the copying (operands into the
     call, result into the answer), not the products: the warmed-up policy calls the tool on about
     40% of its samples, and greedy validation, which takes the likelier first move, guesses and is
     wrong.
  2. GRPO (`train.py --preset demo_cpu_tools`) with the calculator in the agent loop: a sample that
     calls it is right, one that guesses is not, and the reward alone teaches the policy to call it.
     Validation runs through the agent loop too and logs val-aux/agent/* (tool calls per sample, turns,
     stop reasons) beside val-core/*.
  3. The trained policy validated once more with the calculator disabled (multi_turn.enable=false:
     one assistant turn, no tool runs): its accuracy stays near 0, the skill is the tool's use.

Two things make the run hold across seeds. The copying is what the tiny model learns slowly, at a
step that moves with the seed: when the guesses were random numbers, only the conversations that
call the tool trained it, and with --seed 2 it was not learned in 800 steps; with the guess a copy
too, every conversation trains it, and 1200 cosine-scheduled steps (~3.5 min) learned it for every
seed tried (greedy copy accuracy after the warm-up, --seed 0: operands 1.00, results 0.90). And
GRPO's rate: at 5e-4 the failed samples' updates broke the tool-call format faster than the good
ones taught the call (tool calls fell to 0 within 10 steps); at 2e-4 the policy calls on every
validation sample within 5 to 10 steps.

The SFT conversations are rendered by the chat template exactly as the agent loop builds its
sequences (the call's tokens, the tool turn's observation tokens, the answer), so the warm-up trains
on the token sequences GRPO later samples.
"""

from __future__ import annotations

import os
import random

DATA_SOURCE = "arithmetic"
A_RANGE = (10, 99)
B_RANGE = (100, 999)
NUM_TRAIN = 4096
NUM_TEST = 64
NUM_SFT = 2048
CALL_SHARE = 0.4
"""The share of the warm-up's conversations that call the calculator (the others guess)."""
MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}
"""build_tiny_model arguments of the demo's model."""


def tool_call(a: int, b: int) -> str:
    """The assistant's first turn: a calculator call on the question's expression."""
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'


def conversation(a: int, b: int, answer: int) -> list[dict]:
    """A whole tool conversation: question, call, the tool's result, final answer `answer`."""
    return [{"role": "user", "content": f"{a}*{b}="}, {"role": "assistant", "content": tool_call(a, b)},
            {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": f"<answer>{answer}</answer>"}]


def direct_answer(a: int, b: int) -> list[dict]:
    """A conversation without the tool: the question, then a lazy guess, the larger factor copied (never right)."""
    return [{"role": "user", "content": f"{a}*{b}="}, {"role": "assistant", "content": f"<answer>{b}</answer>"}]


def warmup_conversation(a: int, b: int, rng: random.Random) -> list[dict]:
    """One SFT conversation: the calculator's use (CALL_SHARE of them) or a lazy guess.

    With the tool, the final answer is the tool's result: the warm-up teaches the call's format, the
    copying of the question's operands into it and of the result into the answer. Without it, the
    answer is the question's larger factor, copied: wrong (a >= 10), and a copy too, so every
    conversation trains the copying the tool's use needs. The policy then calls the calculator on
    about CALL_SHARE of its samples, and GRPO learns from the reward alone that calling it pays."""
    if rng.random() < CALL_SHARE:
        return conversation(a, b, a * b)
    return direct_answer(a, b)


def build_data(out_dir: str, seed: int = 0) -> None:
    """train/test RL parquets (disjoint random problems) and the format-only SFT parquet (other problems)."""
    from tinyzero.data.preprocess.common import make_row, write_parquet

    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()

    def draw(count: int) -> list[tuple[int, int]]:
        out = []
        while len(out) < count:
            pair = (rng.randint(*A_RANGE), rng.randint(*B_RANGE))
            if pair not in seen:
                seen.add(pair)
                out.append(pair)
        return out

    test, train, sft = draw(NUM_TEST), draw(NUM_TRAIN), draw(NUM_SFT)
    os.makedirs(out_dir, exist_ok=True)
    for split, problems in (("train", train), ("test", test)):
        rows = [make_row(DATA_SOURCE, f"{a}*{b}=", str(a * b), split, i, a=a, b=b, op="*")
                for i, (a, b) in enumerate(problems)]
        write_parquet(rows, os.path.join(out_dir, f"{split}.parquet"))
    write_parquet([{"messages": warmup_conversation(a, b, rng)} for a, b in sft],
                  os.path.join(out_dir, "sft.parquet"))

