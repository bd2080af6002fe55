"""veRL's data sources score as veRL's default_compute_score; the reward-function interface as veRL calls it.

Every expected score below is derived by hand from the rule of veRL's scorer (verl/utils/reward_score/*),
named in the case's comment; the scorers here are written without veRL, sympy or eval.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tinyzero.protocol import DataProto
from tinyzero.rewards import RewardConfig, RewardManager, default_compute_score
from tinyzero.rewards.config import CustomRewardFunctionConfig

PAD_300 = "x" * 300  # pushes what precedes it out of a last-300-characters window


@pytest.mark.parametrize("response,truth,expected", [
    ("so\n#### 72", "72", 1.0),  # strict: the number after "#### "
    ("#### 1,000", "1000", 1.0),  # strict: commas removed from the answer
    ("#### 72 then #### 73", "72", 0.0),  # the last "#### n" counts; found but wrong: format_score 0
    ("#### $72", "72", 0.0),  # "$" breaks the strict pattern: no answer
    ("#### 72.", "72", 0.0),  # the run takes the trailing dot: "72." != "72"
    ("#### -3", "-3", 1.0),  # a leading "-" belongs to the number
    ("#### 72" + PAD_300, "72", 0.0),  # only the last 300 characters are read
    ("#### 72", "$72", 0.0),  # the ground truth is used as given
    ("the answer is 72", "72", 0.0),  # no "####": no strict answer
])
def test_gsm8k(response, truth, expected):
    assert default_compute_score("openai/gsm8k", response, truth) == expected


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"])
@pytest.mark.parametrize("response,truth,expected", [
    ("so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),  # strip_string equal
    ("$\\boxed{\\dfrac12}$", "\\frac{1}{2}", 1.0),  # dfrac -> frac, \frac12 -> \frac{1}{2}
    ("$\\boxed{0.5}$", "\\frac{1}{2}", 1.0),  # "0.5" -> \frac{1}{2}
    ("$\\boxed{3/4}$", "\\frac{3}{4}", 1.0),  # a/b of two integers -> \frac{a}{b}
    ("\\boxed{10\\%}", "10", 1.0),  # "\%" dropped
    ("\\boxed{10%}", "10", 0.0),  # a plain "%" stays in hendrycks' rule
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),  # a unit after "\text{ " is cut
    ("\\boxed{5\\text{ cm}\\text{ m}}", "5", 0.0),  # two units: malformed, raw strings compared
    ("\\boxed{x = 5}", "5", 1.0),  # "x = " dropped (at most 2 characters before the only "=")
    ("\\boxed{90^\\circ}", "90", 1.0),  # degrees dropped
    ("\\boxed{\\$5}", "5", 1.0),  # "\$" dropped
    ("\\boxed{$5$}", "5", 0.0),  # a bare "$" stays in hendrycks' rule
    ("\\boxed{3} and \\boxed{4}", "4", 1.0),  # the last \boxed counts
    ("\\boxed{4} and \\boxed{3}", "4", 0.0),
    ("\\fbox{7}", "7", 0.0),  # \fbox is found but is not "\boxed{": veRL's remove_boxed fails -> 0
    ("\\boxed 7$ done", "7", 1.0),  # "\boxed " form: up to the next "$"
    ("\\boxed{1} \\boxed 7", "7", 1.0),  # any "\boxed " wins over the braced form
    ("\\boxed {7}", "7", 0.0),  # "\boxed " form: the answer is "{7}"
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # unbalanced: no answer
    ("\\boxed{-2}", "-2", 1.0),  # negative numbers compare as strings
    ("\\boxed{\\text{(A)}}", "\\text{(A)}", 1.0),  # \text{} is kept on both sides
    ("no box 4", "4", 0.0),  # missing answer
    ("\\boxed{4}" + PAD_300 * 10, "4", 1.0),  # no window: the whole response is searched
    ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),  # \sqrt3 -> \sqrt{3}
    ("\\boxed{5}", 5, 0.0),  # a non-string ground truth: raw comparison "5" == 5 fails
])
def test_math_reward(source, response, truth, expected):
    assert default_compute_score(source, response, truth) == expected


@pytest.mark.parametrize("source", ["math", "math_dapo", "math_dapo_reasoning", "aime2024", "aime_2025"])
@pytest.mark.parametrize("response,truth,score,pred", [
    ("work\nAnswer: 42", "42", 1.0, "42"),  # the text after "Answer:" to the end of its line
    ("work\nanswer :  42\nmore", "42", 1.0, "42"),  # case-insensitive, spaces around ":", one line only
    ("Answer: 41\nAnswer: 42", "42", 1.0, "42"),  # the last match counts
    ("Answer: 3. Answer: 4", "4", -1.0, "3.Answer:4"),  # matches do not overlap: the whole line, spaces gone
    ("Answer: $\\frac{1}{2}$", "\\frac12", 1.0, "\\frac{1}{2}"),  # \fracab -> \frac{a}{b}, "$" dropped
    ("Answer: 1,000", "1000", 1.0, "1000"),  # digits and commas only: commas dropped
    ("Answer: 5 dollars", "5", 1.0, "5"),  # unit words removed
    ("Answer: x = 7", "7", 1.0, "7"),  # the text after the last "="
    ("Answer: \\boxed{9}", "9", 1.0, "9"),  # \boxed{} unwrapped
    ("Answer: \\text{east}", "east", 1.0, "east"),  # \text{} unwrapped
    ("Answer: -3", "-3", 1.0, "-3"),  # negative numbers
    ("Answer: 42" + PAD_300, "42", -1.0, "[INVALID]"),  # only the last 300 characters are read
    ("The result is \\boxed{42}", "42", -1.0, "[INVALID]"),  # no "Answer:": a boxed answer does not count
    ("Answer: 42.", "42", -1.0, "42."),  # a trailing dot stays
    ("Answer: 90^\\circ", "90", 1.0, "90"),  # ^\circ removed
])
def test_math_dapo(source, response, truth, score, pred):
    out = default_compute_score(source, response, truth)
    assert out == {"score": score, "acc": score > 0, "pred": pred}


@pytest.mark.parametrize("source", ["numina_aops_forum", "numina_synthetic_math", "numina_amc_aime",
                                    "numina_synthetic_amc", "numina_cn_k12", "numina_olympiads"])
@pytest.mark.parametrize("response,truth,expected", [
    ("So the final answer is \\boxed{5}.", "5", 1.0),  # boxed content, graded equal
    ("The answer is 5. Done", "5", 1.0),  # after "answer is", cut at the last ". "
    ("We get \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # \frac{1}{2} renders as 1/2: the same value
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),  # unreduced for grade_answer, equal value in math_equal
    ("\\boxed{50}", "0.5", 1.0),  # math_equal: the reference x 100 (percentage leniency)
    ("\\boxed{0.50001}", "0.5", 1.0),  # math_equal: within rel 1e-4
    ("\\boxed{0.6}", "0.5", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),  # well-formed thousands commas dropped
    ("\\boxed{10\\%}", "10", 1.0),  # percent dropped
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),  # hendrycks unit rule
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),  # tuples element by element
    ("\\boxed{(2, 1)}", "(1,2)", 0.0),
    ("\\boxed{3} and \\boxed{4}", "4", 1.0),  # the last \boxed counts
    ("\\fbox{7}", "7", 1.0),  # prime's extraction takes \fbox
    ("\\boxed{-3}", "-3", 1.0),  # negative numbers
    ("\\boxed{x + 1}", "x+1", 1.0),  # equal as strings without spaces
    ("I do not know", "5", 0.0),  # missing answer
    ("\\boxed{7 3/4}", "7+3/4", 1.0),  # mixed number 7 3/4 -> 7+3/4
])
def test_prime_math(source, response, truth, expected):
    assert default_compute_score(source, response, truth) == expected


@pytest.mark.parametrize("response,truth,expected", [
    ("<think>r</think> so \\boxed{3}", "3", 1.0),  # 0.9 x acc 1 + 0.1 x format 1
    ("so \\boxed{3}", "3", 0.9),  # no <think>: format 0
    ("<think>r</think> so \\boxed{4}", "3", 0.1),  # wrong answer, right format
    ("<think>r</think> no box", "3", 0.0),  # no \boxed{: neither
    (" <think>r</think> \\boxed{3}", "3", 0.9),  # format is a full match: must start with <think>
    ("<think>r</think>\\boxed{50\\%}", "50", 1.0),  # mathruler drops "%"
    ("<think>r</think>\\boxed{\\dfrac{3}{6}}", "\\frac{1}{2}", 0.1),  # unreduced fraction: wrong
    ("<think>r</think>\\boxed{ 12 }", "12", 1.0),  # boxed content stripped
    ("<think>r</think>\\boxed{\\text{B}}", "B", 1.0),  # \text{} unwrapped
])
def test_geo3k(response, truth, expected):
    assert default_compute_score("hiyouga/geometry3k", response, truth) == pytest.approx(expected, abs=0, rel=0)


@pytest.mark.parametrize("source", ["searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                                    "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle"])
@pytest.mark.parametrize("response,target,expected", [
    ("<answer>Paris</answer>", ["Paris"], 1.0),  # exact match
    ("<answer> The  Paris. </answer>", ["paris"], 1.0),  # lower-cased, articles and punctuation dropped
    ("<answer>Lyon</answer><answer>Paris</answer>", ["Paris"], 1.0),  # the last tag counts
    ("<answer>Paris</answer><answer>Lyon</answer>", ["Paris"], 0.0),  # found but wrong: format_score 0
    ("<answer>Paris\nFrance</answer>", ["paris france"], 1.0),  # the tag spans lines
    ("Paris", ["Paris"], 0.0),  # no tag
    ("<answer>x</answer>" * 11 + "<answer>Paris</answer>", ["Paris"], 0.25),  # more than 10 tags: / 4
    ("<answer>Paris</answer>", "Paris", 1.0),  # a single golden answer as a string
    ("<answer>Paris</answer>", np.array(["Lyon", "Paris"], dtype=object), 1.0),  # any of several
])
def test_search_r1(source, response, target, expected):
    assert default_compute_score(source, response, {"target": target}) == expected


def test_tinyzero_sources_keep_their_scorers():
    # TinyZero's countdown rule (0.1 format score) and the 1 / 0 boxed scorer under its own name.
    assert default_compute_score("countdown", "<answer>3*5</answer>", {"target": 64, "numbers": [3, 5]}) == 0.1
    assert default_compute_score("math_boxed", "\\fbox{7}", "7") == 1.0


def test_adversarial_responses_stay_bounded():
    import time

    bodies = ["\\boxed{" * 20_000, "Answer:" + " " * 100_000, "<answer>" * 50_000, "\\frac" * 20_000,
              "<think>" + "</think>" * 20_000 + "\\boxed{" * 20_000, "1" * 100_000 + "/" + "2" * 5000]
    start = time.perf_counter()
    for body in bodies:
        for source in ("openai/gsm8k", "lighteval/MATH", "math_dapo", "numina_olympiads", "hiyouga/geometry3k",
                       "searchR1_nq"):
            truth = {"target": ["x"]} if source == "searchR1_nq" else "5"
            default_compute_score(source, body, truth)
    assert time.perf_counter() - start < 20.0


# ---------------------------------------------------------------- the interface, through RewardManager


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _batch(tokenizer, rows, response_len=40):
    """rows: (data_source, response text, ground truth, extra_info)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    responses = torch.full((len(rows), response_len), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), response_len, dtype=torch.long)
    for i, (_, text, _, _) in enumerate(rows):
        ids = (tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])[:response_len]
        responses[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
    return DataProto.from_dict(
        tensors={"responses": responses, "response_mask": mask},
        non_tensors={"data_source": np.array([r[0] for r in rows], dtype=object),
                     "reward_model": [{"style": "rule", "ground_truth": r[2]} for r in rows],
                     "extra_info": [r[3] for r in rows]})


ROWS = [("math_dapo", "Answer: 42", "42", {"index": 0}), ("math_dapo", "Answer: 41", "42", {"index": 1}),
        ("openai/gsm8k", "#### 5", "5", {"index": 2})]


def test_builtin_dict_keys_travel_as_reward_extra_info(tokenizer):
    out = RewardManager(tokenizer, RewardConfig(num_workers=0))(_batch(tokenizer, ROWS))
    # math_dapo returns score / acc / pred; gsm8k returns a bare number: its row holds None for each key.
    assert out.reward_extra_info == {"score": [1.0, -1.0, None], "acc": [True, False, None],
                                     "pred": ["42", "41", None]}
    assert [s["pred"] for s in out.samples[:2]] == ["42", "41"]
    torch.testing.assert_close(out.scores, torch.tensor([1.0, -1.0, 1.0]))


CUSTOM = '''
import asyncio
import numpy as np

def compute_score(data_source, solution_str, ground_truth, extra_info, weight=1.0, bonus=0.0):
    ok = solution_str.strip() == str(ground_truth)
    return {"score": weight * ok + bonus, "hit": ok, "n": np.int64(len(solution_str)),
            "index": extra_info["index"], "turns": extra_info["num_turns"]}

async def async_score(data_source, solution_str, ground_truth, extra_info, **kw):
    await asyncio.sleep(0)
    return float(solution_str.strip() == str(ground_truth))

def batch_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0, tag=None):
    return [{"score": scale * (s.strip() == str(g)), "tag": tag, "i": e["index"]}
            for s, g, e in zip(solution_strs, ground_truths, extra_infos)]

def positional_only(ds, text, gt, info):
    return (1.0, "ignored") if text.strip() == gt else None
'''

PLAIN = [("anything", "7", "7", {"index": 0}), ("anything", "8", "7", {"index": 1})]


def test_custom_reward_function_keyword_call_with_reward_kwargs(tokenizer, tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    custom = CustomRewardFunctionConfig(path=str(path), reward_kwargs={"weight": 2.0, "bonus": 0.5})
    manager = RewardManager(tokenizer, RewardConfig(num_workers=2, timeout_s=30), custom_function=custom)
    try:
        out = manager(_batch(tokenizer, PLAIN))
    finally:
        manager.close()
    # weight x hit + bonus from reward_kwargs; every key kept, numpy ints as Python ints.
    assert out.reward_extra_info == {"score": [2.5, 0.5], "hit": [True, False], "n": [1, 1], "index": [0, 1],
                                     "turns": [None, None]}
    assert type(out.reward_extra_info["n"][0]) is int
    torch.testing.assert_close(out.scores, torch.tensor([2.5, 0.5]))


def test_async_compute_score(tokenizer, tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    custom = CustomRewardFunctionConfig(path=str(path), name="async_score")
    manager = RewardManager(tokenizer, RewardConfig(num_workers=1, timeout_s=30), custom_function=custom)
    try:
        out = manager(_batch(tokenizer, PLAIN))
    finally:
        manager.close()
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 0.0]))
    assert out.reward_extra_info == {}  # bare numbers carry no extra keys


def test_batch_reward_manager(tokenizer, tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    custom = CustomRewardFunctionConfig(path=str(path), name="batch_score", reward_kwargs={"tag": "fn"})
    manager = RewardManager(tokenizer, RewardConfig(num_workers=1, timeout_s=30), custom_function=custom,
                            reward_manager="batch", reward_kwargs={"scale": 3.0, "tag": "manager"})
    try:
        out = manager(_batch(tokenizer, PLAIN * 2))
    finally:
        manager.close()
    # scale from the manager's kwargs; tag: the function's own reward_kwargs win, as in veRL.
    assert out.reward_extra_info == {"score": [3.0, 0.0, 3.0, 0.0], "tag": ["fn"] * 4, "i": [0, 1, 0, 1]}
    with pytest.raises(ValueError, match="custom_reward_function.path"):
        RewardManager(tokenizer, RewardConfig(), reward_manager="batch")


def test_prime_and_dapo_managers(tokenizer, tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    prime = RewardManager(tokenizer, RewardConfig(num_workers=1, timeout_s=30), reward_manager="prime",
                          custom_function=CustomRewardFunctionConfig(path=str(path), name="positional_only"))
    try:
        out = prime(_batch(tokenizer, PLAIN))
    finally:
        prime.close()
    # prime: a tuple's first element is the score, None scores 0; no reward_extra_info.
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 0.0]))
    assert out.reward_extra_info == {}
    # dapo: a bare-number score is reported as acc; the overlong penalty with log adds its keys. The response
    # "#### 5" + eos is L tokens; with max_resp_len M and buffer B the penalty is min(-(L - (M - B)) / B, 0).
    rows = [("openai/gsm8k", "#### 5", "5", {})]
    length = len(tokenizer("#### 5", add_special_tokens=False)["input_ids"]) + 1
    kwargs = {"overlong_buffer_cfg": {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True},
              "max_resp_len": length + 2}
    out = RewardManager(tokenizer, RewardConfig(num_workers=0), reward_manager="dapo", reward_kwargs=kwargs)(
        _batch(tokenizer, rows))
    expected_penalty = min(-(length - (length + 2 - 4)) / 4, 0.0)
    assert out.reward_extra_info == {"acc": [1.0], "overlong_reward": [expected_penalty], "overlong": [True]}
    assert float(out.token_level_scores.sum()) == pytest.approx(1.0 + expected_penalty, abs=1e-6)


def test_old_custom_fn_and_bad_settings(tokenizer, tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    # reward.custom_fn keeps its positional call.
    manager = RewardManager(tokenizer, RewardConfig(num_workers=1, custom_fn=f"{path}:positional_only",
                                                    on_error="zero"))
    try:
        out = manager(_batch(tokenizer, PLAIN))
    finally:
        manager.close()
    assert out.scores[0] == 0.0 and out.metrics["reward/num_errors"] == 2.0  # a tuple is no score here
    with pytest.raises(ValueError, match="keep one"):
        RewardManager(tokenizer, RewardConfig(custom_fn=f"{path}:positional_only"),
                      custom_function=CustomRewardFunctionConfig(path=str(path)))
    with pytest.raises(ValueError, match="custom_reward_function.reward_kwargs"):
        RewardManager(tokenizer, RewardConfig(), reward_kwargs={"weight": 1})
