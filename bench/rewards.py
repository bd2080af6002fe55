"""Reward scoring throughput: in-process vs the subprocess pool on countdown responses.

    python bench/rewards.py

Interleaves the two sides (A B A B) three times per batch size and reports medians; the last
line is one JSON object.
"""

import json
import statistics
import time

from tinyzero.data.preprocess import countdown
from tinyzero.rewards.scoring import ScoringPool, score_tasks


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    rows = countdown.generate_rows(8192, seed=0)
    tasks = [("countdown", "Let me think. " * 30 + "\n" + f"<answer>{r['extra_info']['solution']}</answer>",
              r["reward_model"]["ground_truth"], r["extra_info"]) for r in rows]
    pool = ScoringPool(2, None, {}, 10.0)
    pool.score(tasks[:8])
    out = {}
    try:
        for n in (256, 2048, 8192):
            inproc, pooled = [], []
            for _ in range(3):
                inproc.append(timed(lambda n=n: score_tasks(tasks[:n], None, {}, 10.0)))
                pooled.append(timed(lambda n=n: pool.score(tasks[:n])))
            out[f"inproc_ms_{n}"] = round(statistics.median(inproc) * 1e3, 2)
            out[f"pool2_ms_{n}"] = round(statistics.median(pooled) * 1e3, 2)
            out[f"us_per_sample_inproc_{n}"] = round(statistics.median(inproc) / n * 1e6, 2)
    finally:
        pool.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
