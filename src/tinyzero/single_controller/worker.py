"""Worker: the base class of every role (actor, critic, reference, reward model).

A Worker lives in each process of its ResourcePool. It knows its rank and world size inside
the pool, its device, the pool's process group, and, per named mesh, its data-parallel rank
and whether it contributes to collected results:

    class ActorWorker(Worker):
        def __init__(self, config):
            super().__init__()
            self.mesh = self.device_mesh((dp, tp), ("dp", "tp"))
            self._register_dispatch_collect_info("actor", dp_rank=self.mesh["dp"].get_local_rank(),
                                                 is_collect=self.mesh["tp"].get_local_rank() == 0)

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="actor")
        def compute_log_prob(self, data: DataProto) -> DataProto: ...
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tinyzero.distributed import on_cleanup
from tinyzero.single_controller.failure import collective_timeout_s
from tinyzero.single_controller.resource_pool import ResourcePool

__all__ = ["Worker"]

_constructing: list[ResourcePool] = []  # the pool a WorkerGroup is building workers on


class Worker:
    """Base class of SPMD workers; construct through a WorkerGroup (or directly, on the whole world)."""

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        pool = _constructing[-1] if _constructing else ResourcePool()
        obj._bind_pool(pool)
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def _bind_pool(self, pool: ResourcePool) -> None:
        from tinyzero.distributed import get_device

        self.resource_pool = pool
        self.global_rank = dist.get_rank()
        self.rank = pool.local_rank_of(self.global_rank)
        self.world_size = pool.world_size
        self.process_group = pool.process_group
        self.device = get_device()
        self._dispatch_collect_info: dict[str, tuple[int, bool]] = {}
        self._meshes: dict[tuple, object] = {}

    # ------------------------------------------------------------------ dispatch info
    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this worker's data-parallel rank on `mesh_name` and whether its output is collected.

        Ranks sharing a dp_rank (a tensor-parallel group) get the same chunk of a
        DP_COMPUTE_PROTO call; exactly one of them must have is_collect=True.
        """
        if dp_rank < 0:
            raise ValueError(f"_register_dispatch_collect_info: dp_rank must be >= 0, got {dp_rank}")
        self._dispatch_collect_info[mesh_name] = (int(dp_rank), bool(is_collect))

    def _query_dispatch_info(self, mesh_name: str) -> int:
        return self._dispatch_collect_info[mesh_name][0]

    def _query_collect_info(self, mesh_name: str) -> bool:
        return self._dispatch_collect_info[mesh_name][1]

    # ------------------------------------------------------------------ meshes
    @property
    def device_type(self) -> str:
        return self.device.type

    def device_mesh(self, shape: Sequence[int] | None = None, names: Sequence[str] = ("fsdp",)):
        """A DeviceMesh over this worker's pool (works when the pool is a subset of the world).

        `shape` defaults to (pool size,); the pool's ranks fill it in row-major order, so the
        last axis holds consecutive ranks (put tensor parallelism there). Called by every rank
        of the pool, in the same order.
        """
        from torch.distributed.device_mesh import DeviceMesh

        shape = tuple(shape or (self.world_size,))
        names = tuple(names)
        if len(names) != len(shape):
            raise ValueError(f"device_mesh: {len(shape)} axes {shape} but {len(names)} names {names}")
        if math.prod(shape) != self.world_size:
            raise ValueError(f"device_mesh: shape {shape} holds {math.prod(shape)} ranks but the pool has "
                             f"{self.world_size} (ranks {self.resource_pool.ranks})")
        key = (shape, names)
        if key in self._meshes:
            return self._meshes[key]
        if len(shape) == 1:
            mesh = DeviceMesh.from_group(self.process_group, self.device_type, mesh_dim_names=names)
        else:
            layout = torch.tensor(self.resource_pool.ranks, dtype=torch.int).reshape(shape)
            coords = [int(c) for c in (layout == self.global_rank).nonzero()[0]]
            groups = []
            for axis in range(len(shape)):
                index = list(coords)
                index[axis] = slice(None)
                axis_ranks = layout[tuple(index)].tolist()
                if len(axis_ranks) == self.world_size:
                    groups.append(self.process_group)
                    continue
                groups.append(_axis_group(axis_ranks, self.resource_pool))
            mesh = DeviceMesh.from_group(groups, self.device_type, mesh=layout, mesh_dim_names=names)
        self._meshes[key] = mesh
        return mesh


_AXIS_GROUPS: dict[tuple, tuple] = {}
on_cleanup(_AXIS_GROUPS.clear)  # the groups are freed (their threads joined) by cleanup()


def _axis_group(ranks: list[int], pool: ResourcePool):
    """The group of one mesh axis, created by its members only and once per rank set.

    Only the members take part (use_local_synchronization), so a pool on a subset never needs
    the ranks outside it; a second mesh over the same ranks reuses the group.
    """
    from datetime import timedelta

    default = dist.distributed_c10d._get_default_group()
    key = (id(default), tuple(ranks))
    if key not in _AXIS_GROUPS:
        timeout = timedelta(seconds=pool.timeout_s if pool.timeout_s is not None else collective_timeout_s())
        with _names_from_ranks_only():
            group = dist.new_group(ranks, use_local_synchronization=True, timeout=timeout)
        _AXIS_GROUPS[key] = (default, group)
    return _AXIS_GROUPS[key][1]


@contextlib.contextmanager
def _names_from_ranks_only():
    """Name a locally synchronised group by its ranks alone while it is created.

    torch names such a group by hashing its ranks together with the number of groups this process
    already knows. Ranks of one pool can know different numbers (only the pool's first rank is in
    its result group, and pools overlap), so the members of an axis would compute different names,
    wait under different store keys and never meet. Every axis group is created once per rank set
    (_AXIS_GROUPS), so its ranks alone name it uniquely.
    """
    c10d = dist.distributed_c10d
    original = c10d._hash_ranks_to_str

    def by_ranks(ranks) -> str:
        name = hashlib.sha1(("tinyzero_axis_" + "_".join(map(str, ranks))).encode()).hexdigest()
        if name in c10d._world.pg_names.values():  # cannot happen through _axis_group; keep torch's rule
            return original(ranks)
        return name

    c10d._hash_ranks_to_str = by_ranks
    try:
        yield
    finally:
        c10d._hash_ranks_to_str = original
