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

Every sample is scored once: under torch.distributed each rank scores samples rank, rank +
world, ... and the results are all-gathered, with a digest of every rank's batch, so all ranks
train on the same rewards and a rank holding a different batch stops the run, named. Call it on
every rank (the trainers do). A user function (reward.custom_fn) runs in killable worker
processes under reward.timeout_s per sample and reward.batch_timeout_s per batch; built-in
scorers are trusted and run in-process (a pool only for large batches). A scorer that raises,
returns no valid finite score, or runs out of the batch budget stops the run with the sample and
the traceback (reward.on_error="raise", the default), or scores 0 and is counted ("zero").
"""

from __future__ import annotations

import hashlib
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tinyzero.distributed import get_rank
from tinyzero.rewards.config import RewardConfig
from tinyzero.rewards.overlong import apply_overlong_penalty
from tinyzero.rewards.registry import check_data_sources, load_custom_fn
from tinyzero.rewards.scoring import ScoringPool, score_tasks
from tinyzero.runtime.progress import report_progress

__all__ = ["RewardError", "RewardManager", "RewardOutput"]

PROGRESS_EVERY_S = 30.0
"""A scoring batch that runs longer than this prints a progress line this often (rank 0)."""


class RewardError(ValueError):
    """A reward could not be computed (reward.on_error="raise"), or the ranks hold different batches."""


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


def _rank() -> int:
    return get_rank()


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _digest(tasks: list) -> str:
    h = hashlib.sha256()
    for task in tasks:
        h.update(repr(task).encode("utf-8", "replace"))
        h.update(b"\0")
    return h.hexdigest()


def _check_same_batch(digests: list[str]) -> None:
    """Raise naming the ranks whose batch differs from the most common one."""
    common, _ = Counter(digests).most_common(1)[0]
    odd = [r for r, d in enumerate(digests) if d != common]
    if odd:
        raise RewardError(f"rank(s) {odd} hold a different batch to score than the other ranks (SPMD divergence: "
                          "every rank must run the same program on the same data; TINYZERO_CHECK_SPMD=1 finds "
                          "the first divergent call)")


def _sample_text(i: int, task: tuple, world: int) -> str:
    data_source, response, ground_truth, _ = task
    where = f", scored on rank {i % world}" if world > 1 else ""
    return (f"sample {i} (data_source {data_source!r}{where}; response {response[:200]!r}; ground_truth "
            f"{ground_truth!r:.200})")


def _response_lengths(data) -> torch.Tensor:
    """Tokens of each response to decode and score: the attention mask's response span (a multi-turn
    response holds observation tokens with response_mask 0 between the model's own), else response_mask."""
    responses = data.batch["responses"]
    if "attention_mask" in data.batch:
        mask = data.batch["attention_mask"][:, -responses.shape[1]:]
    elif "response_mask" in data.batch:
        mask = data.batch["response_mask"]
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
        self._printed: set[str] = set()  # warnings already printed (each kind once per manager)

    def check_data_sources(self, data_sources) -> None:
        """Raise ValueError now if any data_source has no scorer (call before training)."""
        check_data_sources(data_sources, self.config.custom_fn)

    # ------------------------------------------------------------------ scoring
    def _scorer_name(self, data_source: str) -> str:
        if self.config.custom_fn:
            return f"reward.custom_fn {self.config.custom_fn}"
        return f"the built-in scorer of data_source {data_source!r}"

    def _score(self, tasks: list) -> tuple[list[dict], bool]:
        cfg = self.config
        pooled = bool(cfg.custom_fn) or (cfg.num_workers > 0 and len(tasks) >= cfg.parallel_min_batch)
        if not pooled:
            results = score_tasks(tasks, None, cfg.scorer_options(), cfg.timeout_s)
            report_progress("reward", scored=len(tasks), of=len(tasks))
            return results, False
        if self._pool is None:
            self._pool = ScoringPool(max(1, cfg.num_workers), cfg.custom_fn, cfg.scorer_options(), cfg.timeout_s,
                                     batch_timeout_s=cfg.batch_timeout_s if cfg.custom_fn else 0.0)
        start, last_line = time.monotonic(), [time.monotonic()]
        name = self._scorer_name(tasks[0][0]) if tasks else ""

        def on_progress(done: int, total: int) -> None:
            report_progress("reward", scored=done, of=total)
            now = time.monotonic()
            if now - last_line[0] >= PROGRESS_EVERY_S and _rank() == 0:
                last_line[0] = now
                print(f"[reward] {done}/{total} samples scored by {name} in {now - start:.0f} s "
                      f"(reward.batch_timeout_s={cfg.batch_timeout_s:g})", flush=True)

        # A user function (1 sample per message) is charged per sample; built-ins go in chunks.
        return self._pool.score(tasks, chunk_size=1 if cfg.custom_fn else None, on_progress=on_progress), True

    def _score_sharded(self, tasks: list) -> tuple[list[dict], bool]:
        """Every sample scored once across the ranks; every rank gets every result."""
        rank, world = _rank(), _world()
        shard = tasks[rank::world]
        try:
            local, parallel = self._score(shard)
        except Exception as e:  # noqa: BLE001 - e.g. a worker that cannot start: every rank must learn of it
            error = {"score": 0.0, "acc": False, "formatted": False, "error": f"{type(e).__name__}: {e}"[:500],
                     "timeout": False, "traceback": traceback.format_exc()[-4000:]}
            local, parallel = [dict(error) for _ in shard], True
        # Only the first traceback of a shard travels (the others are dropped: one is printed).
        seen = False
        for r in local:
            if "traceback" in r:
                if seen:
                    del r["traceback"]
                seen = True
        if world == 1:
            return local, parallel
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (_digest(tasks), local))
        _check_same_batch([g[0] for g in gathered])
        results: list[dict] = [{}] * len(tasks)
        for r, (_, shard) in enumerate(gathered):
            results[r::world] = shard
        return results, parallel

    def _check_results(self, tasks: list, results: list[dict]) -> None:
        """Apply reward.on_error to the gathered results (the same decision on every rank)."""
        cfg, world = self.config, _world()
        gave_up = [i for i, r in enumerate(results) if r.get("gave_up")]
        if gave_up:
            in_flight = [i for i in gave_up if results[i]["gave_up"] == "in flight"]
            msg = (f"{self._scorer_name(tasks[gave_up[0]][0])} did not finish the batch within reward.batch_timeout_s="
                   f"{cfg.batch_timeout_s:g} s: {len(gave_up)} of {len(tasks)} samples unscored; in flight: "
                   + "; ".join(_sample_text(i, tasks[i], world) for i in in_flight[:3])
                   + ". Make the function faster, raise reward.batch_timeout_s or reward.num_workers")
            if cfg.on_error == "raise":
                raise RewardError(msg + ', or set reward.on_error=zero to score them 0')
            self._print_once("gave_up", f"[reward] warning: {msg}; they score 0 (reward.on_error=zero, counted in "
                                        "reward/num_timeouts)")
        errors = [i for i, r in enumerate(results) if r["error"] is not None]
        if errors:
            i = errors[0]
            msg = (f"{self._scorer_name(tasks[i][0])} failed on {_sample_text(i, tasks[i], world)}: "
                   f"{results[i]['error']}\n{results[i].get('traceback', '').rstrip()}")
            if cfg.on_error == "raise":
                raise RewardError(msg + "\n(set --reward.on_error zero to score such samples 0 and go on)")
            self._print_once("error", f"[reward] warning: {len(errors)} sample(s) failed to score and score 0 "
                                      f"(reward.on_error=zero, counted in reward/num_errors); the first:\n{msg}")
        timeouts = [i for i, r in enumerate(results) if r["timeout"] and not r.get("gave_up")]
        if timeouts:
            i = timeouts[0]
            self._print_once("timeout", f"[reward] warning: {self._scorer_name(tasks[i][0])} ran past reward.timeout_s="
                                        f"{cfg.timeout_s:g} s on {_sample_text(i, tasks[i], world)}; such samples "
                                        "score 0 (counted in reward/num_timeouts; printed once)")

    def _print_once(self, kind: str, message: str) -> None:
        if kind not in self._printed and _rank() == 0:
            self._printed.add(kind)
            print(message, file=sys.stderr, flush=True)

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
        results, parallel = self._score_sharded(tasks)
        self._check_results(tasks, results)
        results = [{k: v for k, v in r.items() if k not in ("traceback", "gave_up")} for r in results]

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
        token_level_scores = apply_overlong_penalty(token_level_scores, lengths, self.config.overlong_buffer, metrics)
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
        if not self.config.num_examine or get_rank() != 0:
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
