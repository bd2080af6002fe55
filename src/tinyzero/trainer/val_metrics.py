"""Validation metrics as veRL names and computes them (process_validation_metrics and its val-core / val-aux split).

    metrics = validation_metrics(data_sources, uids, {"reward": scores, "acc": accs, "pred": preds})
    # {"val-core/gsm8k/acc/mean@4": ..., "val-core/gsm8k/acc/best@4/mean": ..., "val-aux/gsm8k/reward/std@4": ...}

Per data_source, per prompt (uid) and per variable whose values are numbers (the score as "reward"
and every numeric key a scorer returned), over the prompt's N responses: mean@N and std@N; for every
n in 2, 4, 8, ... below N and N itself, best@n / worst@n (the max / min of n responses drawn with
replacement, 1000 draws; the mean and std over the draws) and, when the scorer returns `pred`,
maj@n (the value of the response whose pred wins the vote among the n drawn; ties go to the pred
drawn first, and the value is that of its first draw). Each prompt's numbers are then averaged
over the prompts of the data_source.

The draws follow veRL exactly: every (prompt, variable, n) draws its indices from a fresh NumPy
legacy generator seeded with `seed` (veRL calls np.random.seed(seed) before each np.random.choice),
so the same subsets are drawn for every variable, and the numbers match veRL's for the same
responses. The global NumPy random state is left alone.

val-core holds, per data_source, the core variable ("acc" when the scorer returns it, else
"reward"): its mean@N, best@N/* and maj@N/* at the largest N; everything else is val-aux.
"""

from __future__ import annotations

from collections import defaultdict
from numbers import Number

import numpy as np

N_BOOTSTRAP = 1000
"""Draws per bootstrap estimate (veRL's n_bootstrap)."""

_ROWS_PER_CHUNK = 1 << 22
"""Bound on draws x n x n comparisons held at once by the majority vote."""


def subset_sizes(num_responses: int) -> list[int]:
    """The n of best@n / worst@n / maj@n for a prompt with `num_responses` responses: 2, 4, 8, ... below it, then
    itself (none for a single response)."""
    if num_responses <= 1:
        return []
    sizes, n = [], 2
    while n < num_responses:
        sizes.append(n)
        n *= 2
    return [*sizes, num_responses]


def bootstrap_indices(num_values: int, subset_size: int, n_bootstrap: int = N_BOOTSTRAP,
                      seed: int = 42) -> np.ndarray:
    """(n_bootstrap, subset_size) indices drawn with replacement, as np.random.seed(seed); np.random.choice(...)."""
    return np.random.RandomState(seed).choice(num_values, size=(n_bootstrap, subset_size), replace=True)


def _mean_std(values: np.ndarray) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values))


def best_worst(values: np.ndarray, idx: np.ndarray) -> tuple[tuple[float, float], tuple[float, float]]:
    """((mean, std) of the max, (mean, std) of the min) over the draws `idx` (n_bootstrap, n) of `values`."""
    drawn = values[idx]  # (n_bootstrap, n)
    return _mean_std(drawn.max(axis=1)), _mean_std(drawn.min(axis=1))


def majority(values: np.ndarray, votes: np.ndarray, idx: np.ndarray) -> tuple[float, float]:
    """(mean, std) over the draws of the value of the majority vote: the most common vote among the drawn
    responses (ties: the one drawn first), valued at its first draw. `votes` are integer codes."""
    out = np.empty(idx.shape[0], dtype=np.float64)
    n = idx.shape[1]
    step = max(1, _ROWS_PER_CHUNK // (n * n))
    for start in range(0, idx.shape[0], step):
        rows = idx[start:start + step]  # (rows, n)
        drawn = votes[rows]  # (rows, n)
        counts = (drawn[:, :, None] == drawn[:, None, :]).sum(-1)  # (rows, n): votes like the one at each place
        # The first place holding the highest count is the first draw of the earliest-drawn winning vote.
        first = (counts == counts.max(axis=1, keepdims=True)).argmax(axis=1)  # (rows,)
        out[start:start + len(rows)] = values[rows[np.arange(len(rows)), first]]
    return _mean_std(out)


def _vote_codes(preds: list) -> np.ndarray:
    """One integer per distinct pred (equal as dict keys are equal), in order of first appearance."""
    codes: dict = {}
    out = []
    for p in preds:
        try:
            out.append(codes.setdefault(p, len(codes)))
        except TypeError:  # an unhashable pred (a list, a dict) votes by its text
            out.append(codes.setdefault(("unhashable", repr(p)), len(codes)))
    return np.asarray(out, dtype=np.int64)


def _is_number(value) -> bool:
    return isinstance(value, (Number, np.number, np.bool_)) and not isinstance(value, str)


def prompt_metrics(values: list, preds: list | None, seed: int = 42) -> dict[str, float]:
    """mean@N, std@N, best@n/*, worst@n/*, maj@n/* (with preds) of one prompt's N values of one variable."""
    arr = np.asarray(values, dtype=np.float64)
    n_resps = len(arr)
    out = {f"mean@{n_resps}": float(np.mean(arr))}
    if n_resps <= 1:
        return out
    out[f"std@{n_resps}"] = float(np.std(arr))
    codes = _vote_codes(preds) if preds is not None else None
    for n in subset_sizes(n_resps):
        idx = bootstrap_indices(n_resps, n, seed=seed)
        (out[f"best@{n}/mean"], out[f"best@{n}/std"]), (out[f"worst@{n}/mean"], out[f"worst@{n}/std"]) = \
            best_worst(arr, idx)
        if codes is not None:
            out[f"maj@{n}/mean"], out[f"maj@{n}/std"] = majority(arr, codes, idx)
    return out


def process_validation_metrics(data_sources, uids, infos: dict[str, list], seed: int = 42
                               ) -> dict[str, dict[str, dict[str, float]]]:
    """{data_source: {variable: {metric: value}}}: the per-prompt metrics of every numeric variable, averaged over
    the data_source's prompts. `infos` maps a variable to one value per response (responses in the order of
    `data_sources` and `uids`); a variable whose values for a prompt are not all numbers (a string pred, a
    missing value) is left out for that prompt, and `pred`, when present, is the vote of maj@n."""
    num = len(data_sources)
    for name, column in infos.items():
        if len(column) != num:
            raise ValueError(f"validation variable {name!r} has {len(column)} values for {num} responses; a "
                             "reward function must return one value per response for every key")
    if len(uids) != num:
        raise ValueError(f"{len(uids)} uids for {num} responses")
    groups: dict = defaultdict(lambda: defaultdict(list))  # data_source -> uid -> response rows
    for i, (ds, uid) in enumerate(zip(data_sources, uids)):
        groups[str(ds)][uid].append(i)
    per_var: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # ds -> var -> metric -> values
    for ds, by_uid in groups.items():
        for rows in by_uid.values():
            preds = [infos["pred"][i] for i in rows] if "pred" in infos else None
            for name, column in infos.items():
                values = [column[i] for i in rows]
                if not all(_is_number(v) for v in values):
                    continue
                for metric, value in prompt_metrics(values, preds, seed).items():
                    per_var[ds][name][metric].append(value)
    return {ds: {name: {metric: float(np.mean(vals)) for metric, vals in metrics.items()}
                 for name, metrics in by_var.items()} for ds, by_var in per_var.items()}


def _largest_n(metric_names) -> int:
    return max(int(name.split("@")[-1].split("/")[0]) for name in metric_names)


def validation_metrics(data_sources, uids, infos: dict[str, list], seed: int = 42) -> dict[str, float]:
    """Flat {"val-core|val-aux/<data_source>/<variable>/<metric>": value} as veRL logs them (see the module
    docstring for which go to val-core)."""
    out: dict[str, float] = {}
    for ds, by_var in process_validation_metrics(data_sources, uids, infos, seed).items():
        core_var = "acc" if "acc" in by_var else "reward"
        for name, metrics in by_var.items():
            n_max = _largest_n(metrics)
            for metric, value in metrics.items():
                core = (name == core_var and metric.startswith(("mean", "maj", "best")) and f"@{n_max}" in metric)
                out[f"{'val-core' if core else 'val-aux'}/{ds}/{name}/{metric}"] = value
    return out


def core_mean(metrics: dict, data_source: str) -> float | None:
    """The data_source's val-core mean@N (its accuracy when the scorer reports acc, else its mean score) in a
    metrics row; None when the row has no validation of it."""
    prefix = f"val-core/{data_source}/"
    found = [v for k, v in metrics.items() if k.startswith(prefix) and k[len(prefix):].count("/") == 1
             and k.rsplit("/", 1)[1].startswith("mean@")]
    return found[0] if found else None
