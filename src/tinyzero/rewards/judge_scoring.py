"""The judge's part of a RewardManager call: which samples it scores, the prompt text it reads, the
split of a batch between the judge and the rule scorers, pairwise comparisons after the gather, and
its metrics (see docs/judge.md).

    judging = JudgeScoring(reward_config.judge)                    # loads or reaches the judge
    prompts = judging.prompts(data, decode)                        # the prompt text per sample
    results, parallel = judging.score(tasks, prompts, score_rules) # on this rank's share of the batch
    states, failure = judging.pairwise(data, tasks, prompts, results, rank, world)  # mode=pairwise
    metrics.update(judging.metrics(tasks, states))

The RewardManager keeps the policy for faults (reward.on_error): `score` returns error results like any
scorer, and `pairwise` returns a message naming the first failed comparison, or None.
"""

from __future__ import annotations

import time
from typing import Callable

from tinyzero.rewards.judge import Judge
from tinyzero.rewards.judge_config import JudgeConfig
from tinyzero.rewards.judge_pairwise import group_keys, judge_pairs, ordered_pairs, pairwise_scores

__all__ = ["JudgeScoring", "judge_prompts"]

RuleScorer = Callable[[list], tuple[list[dict], bool]]
"""The RewardManager's rule scoring: tasks -> (one result dict per task, whether a worker pool ran)."""


def judge_prompts(data, decode: Callable[[], list[str] | None]) -> list[str]:
    """The prompt the judge sees per sample: the last user message of `raw_prompt` (data.return_raw_chat),
    else `decode()` (the prompt tokens decoded without special tokens), else empty strings."""
    raw = data.non_tensor_batch.get("raw_prompt")
    if raw is not None:
        texts = []
        for messages in raw:
            users = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
            texts.append(str(users[-1]) if users else "\n".join(str(m.get("content", "")) for m in messages))
        return texts
    decoded = decode()
    return [""] * len(data.batch["responses"]) if decoded is None else [t.strip() for t in decoded]


class JudgeScoring:
    """reward.judge inside the RewardManager (see the module docstring). `time_s` holds the seconds this
    rank spent in the judge during the last call."""

    def __init__(self, config: JudgeConfig, judge: Judge | None = None, ranks: tuple[int, ...] | None = None,
                 rank: int = 0):
        """ranks: the ranks that hold the judge (reward.judge.pool=split), None for every rank; the others
        build no model."""
        self.config = config
        self.ranks = ranks
        if judge is None:
            from tinyzero.rewards.judge import AbsentJudgeBackend

            absent = ranks is not None and rank not in ranks
            judge = Judge(config, backend=AbsentJudgeBackend(config) if absent else None)
        self.judge = judge
        self.name = f"{self.judge.name} (reward.judge)"
        self.time_s = 0.0

    def judges(self, data_source: str) -> bool:
        return self.config.judges(data_source)

    def prompts(self, data, decode: Callable[[], list[str] | None]) -> list[str]:
        return judge_prompts(data, decode)

    def score(self, tasks: list, prompts: list[str] | None, score_rules: RuleScorer) -> tuple[list[dict], bool]:
        """The judge's results for the samples of the data_sources it scores, score_rules' for the rest (in
        one call). With mode=pairwise the judged samples get placeholders, judged by `pairwise` later."""
        self.time_s = 0.0
        judged = [i for i, t in enumerate(tasks) if self.judges(t[0])]
        ruled = [i for i, t in enumerate(tasks) if not self.judges(t[0])]
        results: list[dict] = [{}] * len(tasks)
        parallel = False
        if ruled:
            rule_results, parallel = score_rules([tasks[i] for i in ruled])
            for i, r in zip(ruled, rule_results):
                results[i] = r
        if self.config.mode == "pairwise":  # judged over whole groups after the gather (pairwise)
            judge_results = [{"score": 0.0, "acc": False, "formatted": False, "extra": {}, "error": None,
                              "timeout": False, "judge": "pairwise"} for _ in judged]
        elif not judged:  # nothing of this shard is judged (or the judge is on other ranks)
            judge_results = []
        else:
            start = time.perf_counter()
            judge_results = self.judge.score([prompts[i] if prompts else "" for i in judged],
                                             [tasks[i][1] for i in judged], [tasks[i][2] for i in judged])
            self.time_s = time.perf_counter() - start
        for i, r in zip(judged, judge_results):
            results[i] = r
        return results, parallel

    def pairwise(self, data, tasks: list, prompts: list[str], results: list[dict], rank: int, world: int
                 ) -> tuple[list[str], str | None]:
        """mode=pairwise, on the gathered batch: every ordered pair of each group judged (split over the
        ranks, gathered), each judged sample's entry of `results` set to its share of wins. Returns each
        comparison's judge state and, when comparisons failed, a message naming the first (else None)."""
        judged = [i for i, t in enumerate(tasks) if self.judges(t[0])]
        pairs = ordered_pairs(judged, group_keys(data.non_tensor_batch.get("uid"), prompts, [t[2] for t in tasks]))
        start = time.perf_counter()
        verdicts = judge_pairs(self.judge, pairs, prompts, [t[1] for t in tasks], [t[2] for t in tasks], rank, world,
                               self.ranks)
        self.time_s = time.perf_counter() - start
        failed = [k for k, v in enumerate(verdicts) if v["judge"] != "ok"]
        failure = None
        if failed:
            (i, j), v = pairs[failed[0]], verdicts[failed[0]]
            failure = (f"{self.judge.name} (reward.judge, pairwise) failed on {len(failed)} of {len(pairs)} "
                       f"comparisons; the first, sample {i} against sample {j}: {v['error']}")
        scores = pairwise_scores(judged, pairs, [v["score"] if v["judge"] == "ok" else None for v in verdicts])
        for i in judged:
            results[i] = {**results[i], "score": scores[i], "acc": scores[i] >= 0.5, "formatted": True}
        return [v["judge"] for v in verdicts], failure

    def assign(self, tasks: list, rank: int, world: int) -> list[int]:
        """The indices of the tasks `rank` scores: every rank takes every world-th sample, except that with
        the judge on some ranks only (self.ranks) the judged samples go round those ranks alone."""
        if self.ranks is None:
            return list(range(rank, len(tasks), world))
        judged = [i for i, t in enumerate(tasks) if self.judges(t[0])]
        mine = [i for i, t in enumerate(tasks) if not self.judges(t[0])][rank::world]
        if rank in self.ranks and self.config.mode != "pairwise":  # pairwise: judged after the gather
            mine += judged[self.ranks.index(rank)::len(self.ranks)]
        elif self.config.mode == "pairwise":  # placeholders only, filled by `pairwise`
            mine += judged[rank::world]
        return sorted(mine)

    def metrics(self, tasks: list, states: list) -> dict[str, float]:
        """reward/judge_count, judge_parse_errors, judge_failures and timing_s/reward_judge of one call;
        states: each sample's (pointwise) or comparison's (pairwise) judge state."""
        return {"reward/judge_count": float(sum(self.judges(t[0]) for t in tasks)),
                "reward/judge_parse_errors": float(sum(s == "parse_error" for s in states)),
                "reward/judge_failures": float(sum(s == "failed" for s in states)),
                "timing_s/reward_judge": self.time_s}
