"""veRL's Search-R1 QA scorer (data_source searchR1_nq, _triviaqa, _popqa, _hotpotqa, _2wikimultihopqa,
_musique, _bamboogle): exact match of the last <answer>...</answer>.

The rule of veRL's `verl/utils/reward_score/search_r1_like_qa_em.py`:

1. The answer is the stripped content of the last non-overlapping <answer>...</answer> pair (across
   newlines); none scores 0.
2. Answer and each golden answer (ground_truth["target"]: a string or a list of them) are normalised:
   lower-cased, ASCII punctuation removed, the words a / an / the removed, whitespace collapsed.
3. Equal to any golden answer: `score` (1.0), divided by 4 when the response holds more than 10
   "<answer>" or more than 10 "</answer>" tags; otherwise `format_score` (0.0).
"""

from __future__ import annotations

import re
import string

from tinyzero.rewards.countdown import find_last_tagged

__all__ = ["compute_score", "normalize_answer", "em_check", "extract_solution"]

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)
_MAX_TAGS = 10


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation (rule 2)."""
    text = "".join(c for c in text.lower() if c not in _PUNCT)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def em_check(prediction: str, golden_answers) -> bool:
    """Whether the normalised prediction equals any normalised golden answer."""
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    pred = normalize_answer(prediction)
    return any(normalize_answer(str(g)) == pred for g in golden_answers)


def extract_solution(solution_str: str) -> str | None:
    """The stripped content of the last <answer>...</answer>, or None."""
    content = find_last_tagged(solution_str)
    return None if content is None else content.strip()


def compute_score(solution_str: str, ground_truth, format_score: float = 0.0, score: float = 1.0) -> float:
    """veRL's Search-R1 exact-match score of one response (ground_truth = {"target": str | list})."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    if not em_check(answer, ground_truth["target"]):
        return float(format_score)
    if solution_str.count("<answer>") > _MAX_TAGS or solution_str.count("</answer>") > _MAX_TAGS:
        return score / 4
    return float(score)
