"""Run the TRL harness (bench/trl/grpo_cpu.py) in TRL's bf16 mixed precision, otherwise unchanged.

    python -m torch.distributed.run --nproc_per_node 2 bench/trl_bf16.py HARNESS [harness flags]

Executed by the TRL environment's python (`bench/vs_trl.py --precision bf16`). The harness asks for
fp32 (`GRPOConfig(bf16=False)`, weights loaded in float32); this turns on `bf16=True` whatever it
passes, which is TRL's (and the HF Trainer's) mixed precision: fp32 weights and optimizer, forward,
backward and generation under bf16 autocast. The counterpart on tinyzero's side is FSDP2's
`mixed_precision.param_dtype=bf16` (fp32 master weights) with a bf16 rollout engine.
"""

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: trl_bf16.py HARNESS [harness flags]")
    harness = os.path.abspath(sys.argv[1])
    # Import as the harness would: from its own folder, not this one (bench/kernels.py would shadow
    # the `kernels` package transformers probes for).
    sys.path[0] = os.path.dirname(harness)
    import trl

    post_init = trl.GRPOConfig.__post_init__

    def bf16_post_init(self):
        self.bf16 = True
        post_init(self)

    trl.GRPOConfig.__post_init__ = bf16_post_init
    sys.argv = [harness, *sys.argv[2:]]
    runpy.run_path(harness, run_name="__main__")


if __name__ == "__main__":
    main()
