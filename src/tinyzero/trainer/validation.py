"""Validation: generate for every validation prompt (greedy, or n samples) and score per data_source.

Metrics as veRL names them (tinyzero.trainer.val_metrics): per data_source and per reward variable -- the
score as "reward", and every numeric key the scorer returned (reward_extra_info: acc, ...) --
val-core/<data_source>/<var>/mean@N, best@N/{mean,std} and maj@N/{mean,std} (maj with a `pred` key) for the
core variable ("acc" when scored, else "reward"), val-aux/... for the rest (std@N, worst@n, smaller n,
other variables). The n responses of a prompt are grouped by the row's `uid` when the data has one, else by
the prompt. A multi-turn rollout adds val-aux/num_turns/* and val-aux/agent/* (the agent metrics of
training, over every validation response). With trainer.validation_data_dir every response is written to
DIR/<step>.jsonl (tinyzero.trainer.dumps).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tinyzero.agent.metrics import AGENT_FIELDS, agent_metrics
from tinyzero.data.loader import collate_to_dataproto
from tinyzero.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from tinyzero.trainer.dumps import decode_texts, dump_generations, ground_truths
from tinyzero.trainer.val_metrics import validation_metrics

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


def _extend_infos(infos: dict[str, list], num_before: int, res, count: int) -> None:
    """Append one batch's score ("reward") and reward_extra_info columns; a key new in this batch is None for
    the responses before it, a key this batch lacks is None for its responses."""
    scores = res.token_level_scores.sum(-1).tolist()
    columns = {"reward": scores, **getattr(res, "reward_extra_info", {})}
    for key in columns.keys() - infos.keys():
        infos[key] = [None] * num_before
    for key, column in infos.items():
        column.extend(list(columns[key]) if key in columns else [None] * count)


def validate(trainer, dataset, reward_fn) -> tuple[dict[str, float], list[dict]]:
    """(metrics, samples) over the whole validation set."""
    n = trainer.config.actor_rollout_ref.rollout.val_kwargs.n
    dump_dir = trainer.config.trainer.validation_data_dir
    data_sources: list[str] = []
    uids: list = []
    infos: dict[str, list] = {}
    samples: list[dict] = []
    agent_rows: dict[str, list] = defaultdict(list)
    texts: dict[str, list] = defaultdict(list)
    num_prompts = 0
    for batch in _val_batches(dataset, trainer.config.data.val_batch_size):
        rows = len(batch)
        prompt_uids = (list(batch.non_tensor_batch["uid"]) if "uid" in batch.non_tensor_batch
                       else [f"val-{num_prompts + i}" for i in range(rows)])
        num_prompts += rows
        scored, res = generate_and_score(trainer, batch, reward_fn)
        for key in AGENT_FIELDS:
            agent_rows[key].extend(scored.non_tensor_batch.get(key, []))
        _extend_infos(infos, len(data_sources), res, len(scored))
        data_sources.extend(str(s["data_source"]) for s in res.samples)
        uids.extend(np.repeat(np.asarray(prompt_uids, dtype=object), n))
        if dump_dir:
            inputs, outputs = decode_texts(trainer.tokenizer, scored)
            texts["input"] += inputs
            texts["output"] += outputs
            texts["gts"] += ground_truths(scored)
        samples.extend(res.samples)
    metrics = validation_metrics(data_sources, uids, infos)
    if all(agent_rows[key] for key in AGENT_FIELDS):  # a multi-turn rollout
        metrics.update({f"val-aux/{k}": v for k, v in agent_metrics(agent_rows).items()})
    if dump_dir:
        path = dump_generations(dump_dir, trainer.global_step, texts["input"], texts["output"], texts["gts"],
                                infos["reward"], infos)
        if path:
            trainer.tracker.print(f"[tinyzero] validation generations: {path}")
    return metrics, samples
