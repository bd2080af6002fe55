"""Pairwise preference within a GRPO group (reward.judge.mode=pairwise).

The responses of one prompt form a group: the batch's `uid` where it has one, else the same prompt
text and ground truth. Every ordered pair (i, j), i != j, of a group is judged once with i as answer A
and j as B, so each unordered pair is seen in both orders and the judge's position bias cancels. A
response scores the share of its 2 x (n - 1) comparisons it wins, a tie counting half; a response alone
in its group scores 0.5. The comparisons are split over the ranks (pair k on rank k % world) and
gathered, so every rank computes the same scores.
"""

from __future__ import annotations

from collections import defaultdict

import torch.distributed as dist

__all__ = ["group_keys", "judge_pairs", "ordered_pairs", "pairwise_scores"]


def group_keys(uids, prompts: list[str], ground_truths: list) -> list:
    """The group of each sample: its uid, else (prompt, ground truth)."""
    if uids is not None:
        return [str(u) for u in uids]
    return [(p, repr(g)) for p, g in zip(prompts, ground_truths)]


def ordered_pairs(indices: list[int], keys: list) -> list[tuple[int, int]]:
    """Every ordered pair (i, j), i != j, of the samples in `indices` that share a group, in batch order."""
    groups: dict = defaultdict(list)
    for i in indices:
        groups[keys[i]].append(i)
    return [(i, j) for members in groups.values() for i in members for j in members if i != j]


def pairwise_scores(indices: list[int], pairs: list[tuple[int, int]], preferences: list[float | None]
                    ) -> dict[int, float]:
    """Sample -> share of its comparisons won (preference: A's, 1 / 0 / 0.5; None, a failed comparison,
    counts as a tie); 0.5 for a sample without comparisons."""
    won: dict[int, float] = defaultdict(float)
    seen: dict[int, int] = defaultdict(int)
    for (i, j), pref in zip(pairs, preferences):
        p = 0.5 if pref is None else pref
        won[i] += p
        won[j] += 1.0 - p
        seen[i] += 1
        seen[j] += 1
    return {i: won[i] / seen[i] if seen[i] else 0.5 for i in indices}


def judge_pairs(judge, pairs: list[tuple[int, int]], prompts: list[str], responses: list[str], ground_truths: list,
                rank: int, world: int, judge_ranks: tuple[int, ...] | None = None) -> list[dict]:
    """Judge.compare's result for every pair: the judge's k-th rank (of `judge_ranks`, default every rank)
    judges pairs k, k + len(judge_ranks), ... and the results are all-gathered over the world. A rank
    whose judge raises reports its pairs failed (every rank learns of it)."""
    holders = tuple(range(world)) if judge_ranks is None else tuple(judge_ranks)
    mine = pairs[holders.index(rank)::len(holders)] if rank in holders else []
    try:
        local = judge.compare([prompts[i] for i, _ in mine], [responses[i] for i, _ in mine],
                              [responses[j] for _, j in mine], [ground_truths[i] for i, _ in mine])
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        local = [{"score": 0.0, "judge": "failed", "error": f"{type(e).__name__}: {e}"[:500]} for _ in mine]
    if world == 1:
        return local
    gathered: list = [None] * world
    dist.all_gather_object(gathered, local)
    verdicts: list[dict] = [{}] * len(pairs)
    for k, r in enumerate(holders):
        verdicts[k::len(holders)] = gathered[r]
    return verdicts
