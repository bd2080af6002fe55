"""The SPMD single controller: veRL's driver-calls-workers model on torch.distributed process groups.

Every rank runs the same driver; `wg.method(batch)` dispatches, executes and collects inside
the WorkerGroup's ResourcePool and hands the result to every rank (lazily to ranks outside
the pool, so roles on disjoint pools overlap). README.md ("How it is built") shows a worked example;
decorator.py lists the dispatch modes and worker_group.py the call path.

Environment switches: TINYZERO_CHECK_SPMD=1 (check every rank makes the same calls with the
same arguments), TINYZERO_COLLECTIVE_TIMEOUT_S (pool collectives and result waits),
TINYZERO_ABORT_GRACE_S (how long a rank stuck after another rank's failure waits before it exits).
"""

from tinyzero.single_controller.colocate import create_colocated_worker_cls
from tinyzero.single_controller.decorator import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from tinyzero.single_controller.failure import RemoteWorkerError, SPMDDivergenceError
from tinyzero.single_controller.future import LazyResult, materialize
from tinyzero.single_controller.resource_pool import ResourcePool, ResourcePoolManager
from tinyzero.single_controller.worker import Worker
from tinyzero.single_controller.worker_group import ClassWithInitArgs, WorkerGroup

__all__ = [
    "register",
    "Dispatch",
    "Execute",
    "Worker",
    "WorkerGroup",
    "ClassWithInitArgs",
    "ResourcePool",
    "ResourcePoolManager",
    "create_colocated_worker_cls",
    "make_nd_compute_dataproto_dispatch_fn",
    "RemoteWorkerError",
    "SPMDDivergenceError",
    "LazyResult",
    "materialize",
]
