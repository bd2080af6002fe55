"""Draw a run's curves (reward, validation score, response length, KL, throughput, losses) to PNG.

    python -m tinyzero.plot RUN_DIR [--out RUN_DIR/curves.png]

Reads RUN_DIR/metrics.jsonl (written by the trainer) and draws one panel per group of metrics
that the run logged (tinyzero.trainer.curves). Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import os
import sys

from tinyzero.trainer.curves import plot_run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="run folder holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    args = p.parse_args(argv)
    if not os.path.exists(os.path.join(args.run_dir, "metrics.jsonl")):
        print(f"error: {args.run_dir}/metrics.jsonl not found (is this a run folder?)", file=sys.stderr)
        return 2
    print(plot_run(args.run_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
