"""RewardManager: rule-based scores for a generated batch, placed at each response's last token.

    reward_fn = RewardManager(tokenizer, RewardConfig())
    reward_fn.check_data_sources(train_dataset.data_sources)   # at start-up
    out = reward_fn(batch)                                       # batch: DataProto after generation
    batch.batch["token_level_scores"] = out.token_level_scores   # (batch, response_len) float32
    metrics.update(out.metrics)

The batch needs `responses` (batch, response_len) and `response_mask` (or `attention_mask`
over prompt + response), and non-tensors `data_source`, `reward_model` (a dict with
"ground_truth") and optionally `extra_info`. Only the valid response tokens are decoded
(TinyZero decoded prompt + response and cut at the assistant marker; the result is the same
text). A sample with an empty response is scored but its score has no token to sit on.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from tinyzero.rewards.config import RewardConfig
from tinyzero.rewards.registry import check_data_sources, load_custom_fn
from tinyzero.rewards.scoring import ScoringPool, score_tasks

__all__ = ["RewardManager", "RewardOutput"]


@dataclass
class RewardOutput:
    """What one RewardManager call returns."""

    token_level_scores: torch.Tensor
    """(batch, response_len) float32: the score at the last valid response token, 0 elsewhere."""
    scores: torch.Tensor
    """(batch,) float32 sequence-level scores."""
    metrics: dict[str, float] = field(default_factory=dict)
    """reward/<data_source>/{score_mean,acc,format_rate,count}, overall reward/{...}, error counts."""
    samples: list[dict] = field(default_factory=list)
    """Per sample: data_source, prompt (when `prompts` is in the batch), response, ground_truth,
    score, acc, formatted, error, timeout -- for samples.jsonl."""


def _response_lengths(data) -> torch.Tensor:
    responses = data.batch["responses"]
    if "response_mask" in data.batch:
        mask = data.batch["response_mask"]
    elif "attention_mask" in data.batch:
        mask = data.batch["attention_mask"][:, -responses.shape[1]:]
    else:
        raise ValueError("RewardManager needs `response_mask` or `attention_mask` in the batch to find "
                         "the valid response tokens")
    return mask.to(torch.long).sum(-1)


class RewardManager:
    """Scores generated responses with the data_source's rule (see the module docstring)."""

    def __init__(self, tokenizer, config: RewardConfig | None = None):
        self.tokenizer = tokenizer
        self.config = config if config is not None else RewardConfig()
        if self.config.custom_fn:
            load_custom_fn(self.config.custom_fn)  # fail at start-up on a bad path / name
        self._pool: ScoringPool | None = None

    def check_data_sources(self, data_sources) -> None:
        """Raise ValueError now if any data_source has no scorer (call before training)."""
        check_data_sources(data_sources, self.config.custom_fn)

    # ------------------------------------------------------------------ scoring
    def _score(self, tasks: list) -> tuple[list[dict], bool]:
        cfg = self.config
        if cfg.num_workers > 0 and len(tasks) >= cfg.parallel_min_batch:
            if self._pool is None:
                self._pool = ScoringPool(cfg.num_workers, cfg.custom_fn, cfg.scorer_options(), cfg.timeout_s)
            return self._pool.score(tasks), True
        return score_tasks(tasks, cfg.custom_fn, cfg.scorer_options(), cfg.timeout_s), False

    def __call__(self, data) -> RewardOutput:
        start = time.perf_counter()
        responses = data.batch["responses"]
        batch_size, response_len = responses.shape
        lengths = _response_lengths(data)
        responses_cpu = responses.detach().cpu()
        lengths_list = lengths.cpu().tolist()
        texts = self.tokenizer.batch_decode(
            [responses_cpu[i, :n].tolist() for i, n in enumerate(lengths_list)],
            skip_special_tokens=self.config.skip_special_tokens,
        )
        nt = data.non_tensor_batch
        for key in ("data_source", "reward_model"):
            if key not in nt:
                raise ValueError(f"RewardManager needs non-tensor `{key}` in the batch (from the dataset row)")
        extra = nt.get("extra_info")
        tasks = []
        for i in range(batch_size):
            rm = nt["reward_model"][i]
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                raise ValueError(f"row {i}: reward_model must be a dict with 'ground_truth', got {rm!r}"[:300])
            tasks.append((str(nt["data_source"][i]), texts[i], rm["ground_truth"],
                          extra[i] if extra is not None else None))
        results, parallel = self._score(tasks)

        scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
        token_level_scores = torch.zeros(batch_size, response_len, dtype=torch.float32)
        rows = torch.arange(batch_size)
        has_tokens = lengths.cpu() > 0
        token_level_scores[rows[has_tokens], lengths.cpu()[has_tokens] - 1] = scores[has_tokens]
        token_level_scores = token_level_scores.to(responses.device)

        prompts = self._decode_prompts(data)
        samples = []
        for i, (task, r) in enumerate(zip(tasks, results)):
            sample = {"data_source": task[0], "response": task[1], "ground_truth": task[2], **r}
            if prompts is not None:
                sample = {"prompt": prompts[i], **sample}
            samples.append(sample)
        metrics = self._metrics(tasks, results)
        metrics["reward/parallel"] = float(parallel)
        metrics["timing_s/reward"] = time.perf_counter() - start
        self._examine(samples)
        return RewardOutput(token_level_scores=token_level_scores, scores=scores.to(responses.device),
                            metrics=metrics, samples=samples)

    # ------------------------------------------------------------------ helpers
    def _decode_prompts(self, data) -> list[str] | None:
        if "prompts" not in data.batch:
            return None
        prompts = data.batch["prompts"].detach().cpu()
        if "attention_mask" in data.batch:
            valid = data.batch["attention_mask"][:, :prompts.shape[1]].detach().cpu().bool()
            ids = [prompts[i][valid[i]].tolist() for i in range(prompts.shape[0])]
        else:
            ids = prompts.tolist()
        return self.tokenizer.batch_decode(ids, skip_special_tokens=False)

    @staticmethod
    def _metrics(tasks: list, results: list[dict]) -> dict[str, float]:
        groups: dict[str, list[dict]] = defaultdict(list)
        for task, r in zip(tasks, results):
            groups[task[0]].append(r)
        metrics: dict[str, float] = {}

        def summarize(prefix: str, rs: list[dict]) -> None:
            n = len(rs)
            metrics[f"{prefix}/score_mean"] = sum(r["score"] for r in rs) / n
            metrics[f"{prefix}/acc"] = sum(r["acc"] for r in rs) / n
            metrics[f"{prefix}/format_rate"] = sum(r["formatted"] for r in rs) / n
            metrics[f"{prefix}/count"] = float(n)

        for source, rs in sorted(groups.items()):
            summarize(f"reward/{source}", rs)
        if results:
            summarize("reward", results)
        metrics["reward/num_errors"] = float(sum(r["error"] is not None for r in results))
        metrics["reward/num_timeouts"] = float(sum(r["timeout"] for r in results))
        return metrics

    def _examine(self, samples: list[dict]) -> None:
        if not self.config.num_examine or os.environ.get("RANK", "0") != "0":
            return
        shown: dict[str, int] = defaultdict(int)
        for s in samples:
            if shown[s["data_source"]] < self.config.num_examine:
                shown[s["data_source"]] += 1
                print(f"[reward] {s['data_source']} score={s['score']:.3f} gt={s['ground_truth']!r}\n"
                      f"{s.get('prompt', '')}{s['response']}", flush=True)

    def close(self) -> None:
        """Stop the scoring pool, if one was started."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
