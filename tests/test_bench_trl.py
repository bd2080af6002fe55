"""bench/trl/grpo_cpu.py (the TRL side of bench/vs_trl.py) without TRL: its prompts, as vs_trl reads
them, against a brute-force check of the countdown rule; its reward against vs_trl's; and that it
runs from a clone (nothing outside the repository, only the standard library at import time)."""

from __future__ import annotations

import ast
import itertools
import os
import sys

from bench.trl.grpo_cpu import answer_tag_score, make_prompts
from bench.vs_trl import DEFAULT_HARNESS, ROOT, answer_tag_reward, harness_make_prompts


def _left_to_right(nums, ops):
    value = nums[0]
    for op, x in zip(ops, nums[1:]):
        value = value + x if op == "+" else value - x if op == "-" else value * x
    return value


def test_vs_trl_runs_the_harness_in_the_repository():
    assert os.path.realpath(DEFAULT_HARNESS) == os.path.join(os.path.realpath(ROOT), "bench", "trl", "grpo_cpu.py")
    with open(DEFAULT_HARNESS) as f:
        tree = ast.parse(f.read())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top


def test_prompts_as_vs_trl_reads_them_follow_the_countdown_rule():
    rows = harness_make_prompts(DEFAULT_HARNESS)(64, 3)
    assert rows == make_prompts(64, 3) and rows != make_prompts(64, 4)
    for r in rows:
        nums, target = r["nums"], r["target"]
        assert len(nums) in (3, 4) and all(1 <= x <= 99 for x in nums)
        reachable = {_left_to_right(nums, ops) for ops in itertools.product("+-*", repeat=len(nums) - 1)}
        assert 1 <= target <= 999 and (target in reachable or target == sum(nums))
        (msg,) = r["prompt"]
        assert msg["role"] == "user" and f"make {target}." in msg["content"] and "<answer></answer>" in msg["content"]


def test_rendered_prompts_fit_the_workload_on_the_tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    longest = max(len(tok.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"]) for r in make_prompts(256, 0))
    assert 60 < longest <= 128  # vs_trl's data.max_prompt_length and the harness's --max-prompt-length


def test_both_sides_score_the_same():
    cases = {"": 0.0, "<answer>": 1.0, "a1": 0.05, "<answer>12</answer>": 1.0 + 0.1 * 2 / 19, "xyz": 0.0}
    for text, want in cases.items():
        assert abs(answer_tag_score(text) - want) < 1e-12
        assert answer_tag_reward("answer_tag", text, "5") == answer_tag_score(text)
