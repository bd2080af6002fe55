"""The tools task of the CPU demo: the tiny model learns to use a calculator for 2-digit x 3-digit products.

    python -m tinyzero.demo --task tools [--out runs/demo_tools] [--nproc 2] [--steps N] [--seed S]

A prompt is "23*456=" (a user turn of the chat template). The tiny model cannot multiply, but
it can call the calculator tool in the agent loop (actor_rollout_ref.rollout.multi_turn):

    <|im_start|>assistant\\n<tool_call>{"name": "calculator", "arguments": {"expression": "23*456"}}</tool_call>
    <|im_end|>\\n<|im_start|>tool\\n10488<|im_end|>\\n<|im_start|>assistant\\n      (observation tokens)
    <answer>10488</answer><|im_end|>

scored by the arithmetic rule (the last <answer>N</answer> of the response: 1.0 right, 0.1 another
number, 0 none; the tool's result is not in a tag, so copying it into the answer is the model's job).

  1. SFT warm-up (`train.py sft --preset demo_cpu_tools_sft`) on multi-turn conversations of other
     problems: the call with the question's expression, the tool's true result, and a final answer
     that is a near miss of it (its hundreds digit a random one, see `near_miss`). It teaches the
     tool-call format and the answer format, not the answers: the policy starts at chance accuracy
     (about 0.1: the right hundreds digit 1 time in 10).
  2. GRPO (`train.py --preset demo_cpu_tools`) with the calculator in the loop: the reward alone has
     to teach the model to copy the tool's result exactly. Validation runs through the agent loop too
     and logs val/agent/* (tool calls per sample, turns, stop reasons) beside val/test_acc/*.
     With --seed 0 accuracy goes 0.09 -> 0.84 in the preset's 40 steps; the step at which the
     copying clicks varies with the seed (--seed 1: 0.14 after 40 steps, 0.31 after 60).
  3. The trained policy validated once more with the calculator disabled (multi_turn.enable=false:
     one assistant turn, no tool runs): its accuracy stays near 0, the skill is the tool's use.

The SFT conversations are rendered by the chat template exactly as the agent loop builds its
sequences (the call's tokens, the tool turn's observation tokens, the answer), so the warm-up trains
on the token sequences GRPO later samples.
"""

from __future__ import annotations

import os
import random

from tinyzero.demo import summary, torchrun

DATA_SOURCE = "arithmetic"
A_RANGE = (10, 99)
B_RANGE = (100, 999)
NUM_TRAIN = 4096
NUM_TEST = 64
NUM_SFT = 2048
MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}
"""build_tiny_model arguments of the demo's model."""


def tool_call(a: int, b: int) -> str:
    """The assistant's first turn: a calculator call on the question's expression."""
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'


def conversation(a: int, b: int, answer: int) -> list[dict]:
    """A whole tool conversation: question, call, the tool's result, final answer `answer`."""
    return [{"role": "user", "content": f"{a}*{b}="}, {"role": "assistant", "content": tool_call(a, b)},
            {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": f"<answer>{answer}</answer>"}]


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
    write_parquet([{"messages": conversation(a, b, near_miss(a * b, rng))} for a, b in sft],
                  os.path.join(out_dir, "sft.parquet"))


def near_miss(result: int, rng: random.Random) -> int:
    """`result` with its hundreds digit replaced by a random digit (0-9, independent of it): the warm-up's answer.

    The warm-up teaches the answer format and the copying of the result's other digits; the hundreds
    digit carries no information about the right one, so the policy is right about 1 time in 10, by
    chance. Not a near miss that always differs (result + 1 or + 2 as in the addition demo): a tiny
    model that copies well learns to avoid the right digit exactly, and GRPO then never samples it.
    Not the last digit either: a product's last digit is 0 for 27% of these problems, so a policy that
    always ends in 0 would score 0.27 without copying anything; its hundreds digit is uniform."""
    return result - (result // 100 % 10) * 100 + rng.randint(0, 9) * 100


def validate_without_tools(nproc: int, out: str, common: list[str], env: dict) -> float:
    """Validation accuracy of the trained policy (OUT/grpo/hf_model) with the calculator disabled; printed."""
    torchrun(nproc, ["--preset", "demo_cpu_tools", *common, f"--actor_rollout_ref.model.path={out}/grpo/hf_model",
                     f"--trainer.default_local_dir={out}/no_tools", "--trainer.val_only=true",
                     "--actor_rollout_ref.rollout.multi_turn.enable=false"], env)
    acc = f"val/test_acc/{DATA_SOURCE}"
    without = summary(os.path.join(out, "no_tools"))[-1][acc]
    with_tools = summary(os.path.join(out, "grpo"))[-1][acc]
    print(f"\nvalidation accuracy of the trained policy: {with_tools:.3f} with the calculator, "
          f"{without:.3f} without it")
    return without
