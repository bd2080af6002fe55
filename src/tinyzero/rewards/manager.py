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

With reward.judge.enable, the samples of the data_sources the judge names are scored by an LLM judge
(tinyzero.rewards.judge_scoring; pointwise on each rank's share, or pairwise within each uid group) and the rest
by their rules, in the same batch; judge faults and unparsable verdicts follow reward.on_error.

Every key of a scorer's dict result travels as `RewardOutput.reward_extra_info` (key -> one plain
value per sample, None where a sample's result lacks the key) and in the per-sample records.

veRL's reward managers (reward_model.reward_manager; settings read in tinyzero.rewards.verl_managers)
change how scoring is called:
  naive  one call per sample (the default).
  batch  the user function (custom_reward_function) is called once per rank's share of the batch:
         `fn(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...],
         **reward_model.reward_kwargs)` returning one score or dict per sample.
  dapo   one call per sample on the response with a trailing eos text removed; a bare-number result
         is also reported as reward_extra_info["acc"]; reward_model.reward_kwargs.overlong_buffer_cfg
         (enable, len, penalty_factor, log) with max_resp_len adds DAPO's overlong penalty (log adds
         the "overlong_reward" and "overlong" keys).
  prime  one positional call per sample; a tuple's first element is the score, None scores 0; no
         reward_extra_info (veRL's prime manager returns none). A function that raises follows
         reward.on_error (veRL's prime manager scores it 0 silently).
A user function of custom_reward_function gets extra_info with "num_turns" and
"rollout_reward_scores" added, as veRL's managers pass them.
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
from tinyzero.rewards.config import CustomRewardFunctionConfig, RewardConfig
from tinyzero.rewards.judge_scoring import JudgeScoring
from tinyzero.rewards.overlong import apply_overlong_penalty, overlong_penalty
from tinyzero.rewards.registry import check_data_sources, load_custom_fn
from tinyzero.rewards.scoring import ScoringPool, score_tasks
from tinyzero.rewards.verl_managers import dapo_overlong, scorer_spec
from tinyzero.runtime.progress import report_progress

__all__ = ["RewardError", "RewardManager", "RewardOutput", "reward_extra_info"]

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
    every reward_extra_info key, score, acc, formatted, error, timeout -- for samples.jsonl."""
    reward_extra_info: dict[str, list] = field(default_factory=dict)
    """veRL's reward_extra_info: every key a scorer's dict result held -> one plain Python value per
    sample (None where that sample's result lacks the key); {} when every result was a bare number."""


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


def _strip_suffix(text: str, suffix: str | None) -> str:
    return text[:-len(suffix)] if suffix and text.endswith(suffix) else text


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def reward_extra_info(results: list[dict]) -> dict[str, list]:
    """veRL's reward_extra_info from per-sample results: every key of any sample's "extra" (in first-seen
    order) -> one value per sample, None where a sample lacks the key."""
    keys: dict[str, None] = {}
    for r in results:
        keys.update(dict.fromkeys(r.get("extra", {})))
    return {k: [r.get("extra", {}).get(k) for r in results] for k in keys}


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
    """Scores generated responses with the data_source's rule (see the module docstring).

    custom_function: veRL's custom_reward_function section; reward_manager / reward_kwargs: veRL's
    reward_model.reward_manager and reward_model.reward_kwargs.
    """

    def __init__(self, tokenizer, config: RewardConfig | None = None,
                 custom_function: CustomRewardFunctionConfig | None = None, reward_manager: str = "naive",
                 reward_kwargs: dict | None = None, judge_ranks: tuple[int, ...] | None = None):
        self.tokenizer = tokenizer
        self.config = config if config is not None else RewardConfig()
        self.manager = reward_manager
        manager_kwargs = dict(reward_kwargs or {})
        self.spec = scorer_spec(self.config, custom_function, reward_manager, manager_kwargs)
        self._overlong, self._overlong_log, self._max_resp_len = (
            dapo_overlong(manager_kwargs) if reward_manager == "dapo" else (None, False, None))
        if self._overlong is not None and self._overlong.enable and self.config.overlong_buffer.enable:
            raise ValueError("both reward.overlong_buffer.enable and reward_model.reward_kwargs.overlong_buffer_cfg."
                             "enable are set; keep one")
        if self.spec.custom_fn:
            what = "custom_reward_function" if self.spec.call != "positional" else "reward.custom_fn"
            load_custom_fn(self.spec.custom_fn, what=what)  # fail at start-up on a bad path / name
        self._pool: ScoringPool | None = None
        self._printed: set[str] = set()  # warnings already printed (each kind once per manager)
        # judge_ranks: the ranks holding an in-process judge when reward.judge.pool=split (the builder takes
        # them from the run plan), None for every rank.
        self._judging = JudgeScoring(self.config.judge, ranks=judge_ranks, rank=_rank()) \
            if self.config.judge.enable else None

    def check_data_sources(self, data_sources) -> None:
        """Raise ValueError now if any data_source has no scorer (call before training)."""
        check_data_sources([d for d in data_sources if not self.config.judge.judges(str(d))], self.spec.custom_fn)

    # ------------------------------------------------------------------ scoring
    def _scorer_name(self, data_source: str) -> str:
        if self._judging is not None and self._judging.judges(data_source):
            return self._judging.name
        if self.spec.custom_fn:
            what = "reward.custom_fn" if self.spec.call == "positional" else "custom_reward_function"
            return f"{what} {self.spec.custom_fn}"
        return f"the built-in scorer of data_source {data_source!r}"

    def _score(self, tasks: list, prompts: list[str] | None) -> tuple[list[dict], bool]:
        """The judge's results for the samples of the data_sources it scores, the rule scorers' for the rest."""
        if self._judging is None:
            return self._score_rules(tasks)
        return self._judging.score(tasks, prompts, self._score_rules)

    def _score_rules(self, tasks: list) -> tuple[list[dict], bool]:
        cfg, custom = self.config, bool(self.spec.custom_fn)
        pooled = custom or (cfg.num_workers > 0 and len(tasks) >= cfg.parallel_min_batch)
        if not pooled:
            results = score_tasks(tasks, timeout_s=cfg.timeout_s, spec=self.spec)
            report_progress("reward", scored=len(tasks), of=len(tasks))
            return results, False
        if self._pool is None:
            self._pool = ScoringPool(max(1, cfg.num_workers), timeout_s=cfg.timeout_s, spec=self.spec,
                                     batch_timeout_s=cfg.batch_timeout_s if custom else 0.0)
        start, last_line = time.monotonic(), [time.monotonic()]
        name = self._scorer_name(tasks[0][0]) if tasks else ""

        def on_progress(done: int, total: int) -> None:
            report_progress("reward", scored=done, of=total)
            now = time.monotonic()
            if now - last_line[0] >= PROGRESS_EVERY_S and _rank() == 0:
                last_line[0] = now
                print(f"[reward] {done}/{total} samples scored by {name} in {now - start:.0f} s "
                      f"(reward.batch_timeout_s={cfg.batch_timeout_s:g})", flush=True)

        # A user function (1 sample per message) is charged per sample; built-ins go in chunks; a batch
        # function gets the rank's whole share in one call.
        chunk = max(1, len(tasks)) if self.spec.call == "batch" else 1 if custom else None
        return self._pool.score(tasks, chunk_size=chunk, on_progress=on_progress), True

    def _score_sharded(self, tasks: list, prompts: list[str] | None = None) -> tuple[list[dict], bool]:
        """Every sample scored once across the ranks; every rank gets every result."""
        rank, world = _rank(), _world()
        assign = self._judging.assign if self._judging is not None else \
            (lambda tasks, r, w: list(range(r, len(tasks), w)))
        picked = assign(tasks, rank, world)
        shard = [tasks[i] for i in picked]
        try:
            local, parallel = self._score(shard, [prompts[i] for i in picked] if prompts is not None else None)
        except Exception as e:  # noqa: BLE001 - e.g. a worker that cannot start: every rank must learn of it
            error = {"score": 0.0, "acc": False, "formatted": False, "extra": {},
                     "error": f"{type(e).__name__}: {e}"[:500], "timeout": False,
                     "traceback": traceback.format_exc()[-4000:]}
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
            for i, result in zip(assign(tasks, r, world), shard):
                results[i] = result
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
        if self.manager == "dapo":
            texts = [_strip_suffix(t, getattr(self.tokenizer, "eos_token", None)) for t in texts]
        tasks = []
        for i in range(batch_size):
            rm = nt["reward_model"][i]
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                raise ValueError(f"row {i}: reward_model must be a dict with 'ground_truth', got {rm!r}"[:300])
            tasks.append((str(nt["data_source"][i]), texts[i], rm["ground_truth"], self._extra_info(nt, i)))
        judging = self._judging
        prompts = judging.prompts(data, lambda: self._decode_prompts(data, skip_special_tokens=True)) \
            if judging is not None else None
        results, parallel = self._score_sharded(tasks, prompts)
        self._check_results(tasks, results)
        judge_states = [r.get("judge") for r in results]
        if judging is not None and judging.config.mode == "pairwise":
            judge_states, failure = judging.pairwise(data, tasks, prompts, results, _rank(), _world())
            if failure and self.config.on_error == "raise":
                raise RewardError(failure + "\n(set --reward.on_error zero to count such comparisons as ties and go on)")
            if failure:
                self._print_once("pairwise", f"[reward] warning: {failure}; they count as ties (reward.on_error=zero)")
        results = [{k: v for k, v in r.items() if k not in ("traceback", "gave_up", "judge")} for r in results]
        if self.manager == "prime":
            for r in results:
                r["extra"] = {}
        elif self.manager == "dapo":
            for r in results:
                if not r["extra"] and r["error"] is None and not r["timeout"]:
                    r["extra"] = {"acc": r["score"]}  # veRL's DAPO manager reports a bare score as acc

        scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
        token_level_scores = torch.zeros(batch_size, response_len, dtype=torch.float32)
        rows = torch.arange(batch_size)
        has_tokens = lengths.cpu() > 0
        token_level_scores[rows[has_tokens], lengths.cpu()[has_tokens] - 1] = scores[has_tokens]
        token_level_scores = token_level_scores.to(responses.device)

        metrics = self._metrics(tasks, results)
        token_level_scores = apply_overlong_penalty(token_level_scores, lengths, self.config.overlong_buffer, metrics)
        if self._overlong is not None and self._overlong.enable:
            token_level_scores = apply_overlong_penalty(token_level_scores, lengths, self._overlong, metrics,
                                                        max_response_length=self._max_resp_len)
            if self._overlong_log:
                m = self._max_resp_len or response_len
                penalty = overlong_penalty(lengths.cpu(), m, self._overlong.len, self._overlong.penalty_factor)
                for r, p in zip(results, penalty.tolist()):
                    r["extra"] = {**r["extra"], "overlong_reward": p, "overlong": p < 0}
        extra_info = reward_extra_info(results)
        prompts = self._decode_prompts(data)
        samples = []
        for i, (task, r) in enumerate(zip(tasks, results)):
            core = {k: v for k, v in r.items() if k != "extra"}
            sample = {"data_source": task[0], "response": task[1], "ground_truth": task[2], **r["extra"], **core}
            if prompts is not None:
                sample = {"prompt": prompts[i], **sample}
            samples.append(sample)
        metrics["reward/parallel"] = float(parallel)
        if judging is not None:
            metrics.update(judging.metrics(tasks, judge_states))
        metrics["timing_s/reward"] = time.perf_counter() - start
        self._examine(samples)
        return RewardOutput(token_level_scores=token_level_scores, scores=scores.to(responses.device),
                            metrics=metrics, samples=samples, reward_extra_info=extra_info)

    def _extra_info(self, nt, i: int):
        """Row i's extra_info; for a custom_reward_function, a copy with veRL's num_turns and
        rollout_reward_scores added."""
        extra = nt.get("extra_info")
        row = extra[i] if extra is not None else None
        if not self.spec.custom_fn or self.spec.call not in ("keyword", "batch"):
            return row
        row = dict(row) if isinstance(row, dict) else {}
        turns = nt.get("__num_turns__", nt.get("num_turns"))
        row["num_turns"] = None if turns is None else _plain(turns[i])
        scores = nt.get("reward_scores")
        row["rollout_reward_scores"] = scores[i] if scores is not None else {}
        return row

    # ------------------------------------------------------------------ helpers
    def _decode_prompts(self, data, skip_special_tokens: bool = False) -> list[str] | None:
        if "prompts" not in data.batch:
            return None
        prompts = data.batch["prompts"].detach().cpu()
        if "attention_mask" in data.batch:
            valid = data.batch["attention_mask"][:, :prompts.shape[1]].detach().cpu().bool()
            ids = [prompts[i][valid[i]].tolist() for i in range(prompts.shape[0])]
        else:
            ids = prompts.tolist()
        return self.tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)

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
