"""Teardown leaves no thread behind: after train.py's `stop_watchdog(); cleanup()` nothing runs into exit.

A daemon thread that is inside a torch call with the GIL released (a store call) when the interpreter
finalizes cannot take the GIL back; CPython ends it with pthread_exit, and the unwinding through a
noexcept C++ frame aborts the process ("terminate called without an active exception") after a run
that succeeded. Groups kept by module caches are torn down during finalization instead of by cleanup().
This test checks the invariant on 2 gloo ranks: after the teardown, no watchdog thread is alive and the
gloo worker / transport threads of every group the controller created are joined.
"""

from __future__ import annotations

import os
import threading

from tests.dist_utils import run_distributed


def _gloo_threads() -> int:
    """Native threads of gloo groups in this process (worker loops and transport loops)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += "gloo" in f.read()
        except OSError:
            pass
    return count


def _teardown_case():
    import torch
    import torch.distributed as dist

    from tinyzero.distributed import cleanup, init_distributed
    from tinyzero.runtime.progress import report_progress, start_watchdog, stop_watchdog
    from tinyzero.single_controller import ResourcePool

    init_distributed(60)
    start_watchdog(1.0)  # heartbeats every 0.2 s over its own store connection
    pool = ResourcePool()  # the control group, the abort watchdog
    t = torch.ones(4)
    dist.all_reduce(t, group=pool.control_group)
    report_progress("step", step=1)
    before = (sorted(th.name for th in threading.enumerate() if th.name.startswith("tinyzero")), _gloo_threads())
    del pool
    stop_watchdog()
    cleanup()
    after = (sorted(th.name for th in threading.enumerate() if th is not threading.main_thread()),
             _gloo_threads())
    return before, after, float(t[0])


def test_teardown_joins_watchdogs_and_group_threads():
    for before, after, value in run_distributed(_teardown_case, 2, timeout=240):
        assert value == 2.0
        # Before: both watchdogs run and the groups have their threads (the check below is not vacuous).
        assert before[0] == ["tinyzero-abort-watchdog", "tinyzero-hang-watchdog"], before
        assert before[1] > 0, before
        # After: no Python thread but the main one, no gloo thread.
        assert after == ([], 0), after
