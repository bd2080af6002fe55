"""A worker that dies while its peers wait inside a collective must end the whole job, with its
traceback, in bounded time (launched with torchrun exactly as a user would run a job).

Run as a job: torchrun --nproc_per_node 2 tests/test_single_controller_failure.py stuck
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tinyzero.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)


class StuckWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def step(self):
        if self.rank == 1:
            raise RuntimeError("fatal error on rank 1 before the all_reduce")
        t = torch.ones(1)
        dist.all_reduce(t, group=self.process_group)  # rank 1 never joins: rank 0 waits here
        return float(t)


def _job() -> None:
    from tinyzero.distributed import init_distributed

    init_distributed(timeout_s=600)  # far longer than the test allows: the abort path must act first
    wg = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=ClassWithInitArgs(StuckWorker))
    wg.step()
    print("unreachable: the job went on after a worker failed", flush=True)


@pytest.mark.slow
def test_failure_inside_a_collective_ends_the_job_with_the_traceback():
    from tests.dist_utils import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", TINYZERO_ABORT_GRACE_S="2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), __file__, "stuck"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "RuntimeError: fatal error on rank 1 before the all_reduce" in out, out[-3000:]
    assert "unreachable" not in out
    # start-up of two ranks plus the 2 s grace; the collective timeout (600 s) is never reached
    assert elapsed < 120, f"the job took {elapsed:.0f} s to end"


if __name__ == "__main__":
    if sys.argv[1:] == ["stuck"]:
        _job()
