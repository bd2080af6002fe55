"""DAPO's dynamic sampling filter: drop the groups whose samples all have the same metric value.

A group is the n samples of one prompt (the same `uid`). When every sample of a group has the
same reward, a group-relative advantage is 0 for all of them and the group teaches nothing;
DAPO (veRL: algorithm.filter_groups) drops such groups and samples more prompts until the train
batch is full (the loop is PPOTrainer.rollout_filtered). A group of one sample is kept, as in veRL.

"Same" is exact equality. veRL tests np.std(values) > 0, which keeps a group of three 0.1 scores
(their std is 1.4e-17 in float64); equality drops it, as intended.

The per-sample metric comes from a registry (name -> function of the scored batch), so a new
metric is a decorated function:

    @register_filter_metric("my_metric")
    def my_metric(batch: DataProto) -> np.ndarray: ...      # (rows,)

    kept = filter_groups(batch.non_tensor_batch["uid"], FILTER_METRICS["acc"](batch))
    batch = batch.select_idxs(kept.rows)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tinyzero.protocol import DataProto

__all__ = ["FILTER_METRICS", "GroupFilterResult", "filter_groups", "register_filter_metric"]

FILTER_METRICS: dict[str, Callable[[DataProto], np.ndarray]] = {}
"""Filter metric name -> function of a scored batch returning one value per row."""


def register_filter_metric(name: str):
    """Decorator: make a per-sample metric available as algorithm.filter_groups.metric=name."""

    def wrap(fn: Callable[[DataProto], np.ndarray]) -> Callable[[DataProto], np.ndarray]:
        if name in FILTER_METRICS:
            raise ValueError(f"filter metric {name!r} is already registered")
        FILTER_METRICS[name] = fn
        return fn

    return wrap


def _non_tensor(batch: DataProto, key: str) -> np.ndarray:
    if key not in batch.non_tensor_batch:
        raise ValueError(f"algorithm.filter_groups.metric={key!r} needs per-sample {key!r} values from the reward "
                         "function (the trainer stores them after scoring); use metric=seq_reward instead")
    return np.asarray(batch.non_tensor_batch[key], dtype=np.float64)


@register_filter_metric("acc")
def _acc(batch: DataProto) -> np.ndarray:
    """The scorer's accuracy per sample (before overlong shaping)."""
    return _non_tensor(batch, "acc")


@register_filter_metric("score")
def _score(batch: DataProto) -> np.ndarray:
    """The scorer's score per sample (before overlong shaping, as veRL's reward_extra_info["score"])."""
    return _non_tensor(batch, "score")


@register_filter_metric("seq_reward")
def _seq_reward(batch: DataProto) -> np.ndarray:
    """The summed token_level_scores: rule score + overlong penalty (+ a reward model's score)."""
    return batch.batch["token_level_scores"].sum(-1).double().cpu().numpy()


@register_filter_metric("seq_final_reward")
def _seq_final_reward(batch: DataProto) -> np.ndarray:
    """The summed token_level_rewards; before the in-reward KL (applied after filtering) they are the scores."""
    key = "token_level_rewards" if "token_level_rewards" in batch.batch else "token_level_scores"
    return batch.batch[key].sum(-1).double().cpu().numpy()


@dataclass
class GroupFilterResult:
    """Which rows survive the filter."""

    rows: np.ndarray
    """int64 indices of the kept rows, in their original order."""
    num_groups: int
    """Groups (distinct uids) in the input."""
    num_kept_groups: int
    """Groups whose samples differ in the metric (or that hold one sample)."""


def filter_groups(uids: np.ndarray, values: np.ndarray) -> GroupFilterResult:
    """Keep the rows of every group (same uid) whose values are not all equal; one-sample groups stay."""
    uids, values = np.asarray(uids), np.asarray(values)
    if uids.shape != values.shape or uids.ndim != 1:
        raise ValueError(f"filter_groups: uids {uids.shape} and values {values.shape} must be 1-d of one length")
    groups: dict = {}
    for i, uid in enumerate(uids):
        groups.setdefault(uid, []).append(i)
    kept = {uid for uid, rows in groups.items()
            if len(rows) == 1 or not np.all(values[rows] == values[rows[0]])}
    rows = np.array([i for i, uid in enumerate(uids) if uid in kept], dtype=np.int64)
    return GroupFilterResult(rows=rows, num_groups=len(groups), num_kept_groups=len(kept))
