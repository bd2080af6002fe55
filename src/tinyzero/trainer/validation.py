"""Validation: generate for every validation prompt (greedy, or n samples) and score per data_source.

Metrics (veRL names): val/test_score/<data_source> (mean score over responses), and
val/test_acc/<data_source> where the scorer reports accuracy; with val_kwargs.n > 1 also
val/test_score/<data_source>/best@<n> and val/test_acc/<data_source>/pass@<n>. A multi-turn rollout
adds val/agent/* (the agent/* metrics of training, over every validation response).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tinyzero.agent.metrics import AGENT_FIELDS, agent_metrics
from tinyzero.data.loader import collate_to_dataproto
from tinyzero.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

GEN_KEYS = ["input_ids", "attention_mask", "position_ids"]
GEN_NON_TENSOR_KEYS = ["raw_prompt_ids"]


def _val_batches(dataset, batch_size: int | None):
    size = batch_size or len(dataset)
    for start in range(0, len(dataset), size):
        indices = list(range(start, min(start + size, len(dataset))))
        items = dataset.__getitems__(indices) if hasattr(dataset, "__getitems__") else [dataset[i] for i in indices]
        yield collate_to_dataproto(items)


def generate_and_score(trainer, batch: DataProto, reward_fn):
    """Greedy / val_kwargs generation for one prompt batch; returns (scored batch, RewardOutput)."""
    n = trainer.config.actor_rollout_ref.rollout.val_kwargs.n
    gen_batch = batch.pop(batch_keys=GEN_KEYS, non_tensor_batch_keys=GEN_NON_TENSOR_KEYS)
    gen_batch.meta_info.update(trainer._gen_meta(do_sample=False, validate=True))
    gen_batch, pad = pad_dataproto_to_divisor(gen_batch, trainer.roles.rollout_dp_size)
    out = trainer.roles.actor_rollout.generate_sequences(gen_batch)
    out = unpad_dataproto(out, pad * n)
    batch = batch.repeat(n, interleave=True).union(out)
    return batch, reward_fn(batch)


def validate(trainer, dataset, reward_fn) -> tuple[dict[str, float], list[dict]]:
    """(metrics, samples) over the whole validation set."""
    n = trainer.config.actor_rollout_ref.rollout.val_kwargs.n
    scores: dict[str, list[float]] = defaultdict(list)
    accs: dict[str, list[float]] = defaultdict(list)
    samples: list[dict] = []
    agent_rows: dict[str, list] = defaultdict(list)
    for batch in _val_batches(dataset, trainer.config.data.val_batch_size):
        scored, res = generate_and_score(trainer, batch, reward_fn)
        for key in AGENT_FIELDS:
            agent_rows[key].extend(scored.non_tensor_batch.get(key, []))
        for sample in res.samples:
            ds = str(sample["data_source"])
            scores[ds].append(float(sample["score"]))
            if "acc" in sample:
                accs[ds].append(float(sample["acc"]))
        samples.extend(res.samples)
    metrics: dict[str, float] = {}
    for ds, values in scores.items():
        metrics[f"val/test_score/{ds}"] = float(np.mean(values))
        if n > 1:
            metrics[f"val/test_score/{ds}/best@{n}"] = float(np.asarray(values).reshape(-1, n).max(1).mean())
    for ds, values in accs.items():
        metrics[f"val/test_acc/{ds}"] = float(np.mean(values))
        if n > 1:
            metrics[f"val/test_acc/{ds}/pass@{n}"] = float(np.asarray(values).reshape(-1, n).max(1).mean())
    if all(agent_rows[key] for key in AGENT_FIELDS):  # a multi-turn rollout
        metrics.update({f"val/{k}": v for k, v in agent_metrics(agent_rows).items()})
    return metrics, samples
