"""ResourcePool (a set of global ranks with its own process group) and ResourcePoolManager (role -> pool).

`dist.new_group` is collective over the whole world, so every rank constructs every pool, in
the same order -- the driver is SPMD, so writing `ResourcePool(ranks=[0, 1])` in the driver
does exactly that. Pools with the same ranks share their groups; a pool over the whole world
uses the default group (no new communicator). A pool on a subset also gets a "result" group:
its first rank plus every rank outside it, used to hand results to the ranks that skipped the
work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch.distributed as dist

from tinyzero.distributed import on_cleanup
from tinyzero.single_controller.failure import collective_timeout_s, start_watchdog
from tinyzero.single_controller.spmd import check_same_call, next_call_seq, spmd_check_enabled

__all__ = ["ResourcePool", "ResourcePoolManager", "ensure_distributed"]

_GROUP_CACHE: dict[tuple, tuple] = {}
on_cleanup(_GROUP_CACHE.clear)  # the groups are freed (their threads joined) by cleanup()


def ensure_distributed() -> None:
    """Initialise torch.distributed (torchrun env, or a group of one) if nothing did yet."""
    if not dist.is_initialized():
        from tinyzero.distributed import init_distributed

        init_distributed()


def _groups_for(ranks: tuple[int, ...], timeout_s: float | None):
    """(process_group, control_group, result_group) of a pool; created once per rank set, in call order."""
    world = dist.get_world_size()
    default = dist.distributed_c10d._get_default_group()
    key = (id(default), ranks, timeout_s)
    if key in _GROUP_CACHE:
        return _GROUP_CACHE[key][1:]
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else collective_timeout_s())
    tag = "_".join(map(str, ranks))[:60]
    if len(ranks) == world and timeout_s is None:
        group = dist.group.WORLD
    else:
        group = dist.new_group(ranks=list(ranks), timeout=timeout, group_desc=f"pool_{tag}")
    # The controller's own traffic (status, gathers) never shares a group with the workers'
    # collectives, so a rank that fails mid-method cannot pair its status with a peer's all_reduce.
    # gloo: it only carries CPU objects, so it never costs a GPU communicator.
    control = dist.new_group(ranks=list(ranks), timeout=timeout, backend="gloo", group_desc=f"pool_control_{tag}")
    outside = [r for r in range(world) if r not in ranks]
    result = None
    if outside:
        result = dist.new_group(ranks=sorted([ranks[0], *outside]), timeout=timeout, group_desc=f"pool_result_{tag}")
    _GROUP_CACHE[key] = (default, group, control, result)
    return group, control, result


class ResourcePool:
    """A set of global ranks that one or more roles run on.

    Args:
        ranks: global ranks of the pool, in order (default: every rank). The first is the
            pool's rank 0.
        timeout_s: timeout of the pool's collectives (default TINYZERO_COLLECTIVE_TIMEOUT_S, or
            the default group's timeout when the pool is the whole world).
    """

    def __init__(self, ranks: Sequence[int] | None = None, timeout_s: float | None = None, name: str | None = None):
        ensure_distributed()
        world = dist.get_world_size()
        ranks = list(range(world)) if ranks is None else [int(r) for r in ranks]
        if not ranks:
            raise ValueError("ResourcePool: ranks must not be empty")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ResourcePool: ranks {ranks} contain duplicates")
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise ValueError(f"ResourcePool: ranks {bad} are outside the world of {world} ranks "
                             f"(launch with torchrun --nproc_per_node {max(ranks) + 1} or shrink the pool)")
        if ranks != sorted(ranks):
            raise ValueError(f"ResourcePool: list ranks in increasing order, got {ranks}")
        if spmd_check_enabled():  # new_group is collective: every rank must build the same pools in order
            check_same_call(next_call_seq(), "ResourcePool", (ranks, timeout_s), {})
        self.ranks: list[int] = ranks
        self.timeout_s = timeout_s
        self.name = name or f"pool[{ranks[0]}..{ranks[-1]}]"
        self.process_group, self.control_group, self.result_group = _groups_for(tuple(ranks), timeout_s)
        start_watchdog()

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def covers_world(self) -> bool:
        return len(self.ranks) == dist.get_world_size()

    def __contains__(self, global_rank: int) -> bool:
        return global_rank in self.ranks

    def local_rank_of(self, global_rank: int) -> int:
        """The pool rank of a global rank (ValueError when it is not in the pool)."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not in {self.name} (ranks {self.ranks})") from None

    @property
    def is_local(self) -> bool:
        """Whether this process is one of the pool's ranks."""
        return dist.get_rank() in self.ranks

    def __repr__(self) -> str:
        return f"ResourcePool(ranks={self.ranks})"


class ResourcePoolManager:
    """Named pools and which pool each role runs on.

    `resource_pool_spec` maps a pool name to its global ranks; `mapping` maps a role (any
    hashable, e.g. "actor_rollout" or an enum) to a pool name. Pools are created in sorted name
    order, which is the same on every rank.

        ResourcePoolManager({"global_pool": list(range(8))},
                            {"actor_rollout": "global_pool", "critic": "global_pool"})
        ResourcePoolManager({"actor": [0, 1, 2, 3], "critic": [4, 5, 6, 7]},
                            {"actor_rollout": "actor", "ref": "actor", "critic": "critic"})
    """

    def __init__(self, resource_pool_spec: Mapping[str, Sequence[int]], mapping: Mapping,
                 timeout_s: float | None = None):
        unknown = {role: name for role, name in mapping.items() if name not in resource_pool_spec}
        if unknown:
            raise ValueError(f"ResourcePoolManager: roles map to undefined pools {unknown}; "
                             f"defined pools: {sorted(resource_pool_spec)}")
        self.resource_pool_spec = {k: list(v) for k, v in resource_pool_spec.items()}
        self.mapping = dict(mapping)
        self.timeout_s = timeout_s
        self.resource_pool_dict: dict[str, ResourcePool] = {}

    def create_resource_pool(self) -> None:
        for name in sorted(self.resource_pool_spec):
            if name not in self.resource_pool_dict:
                self.resource_pool_dict[name] = ResourcePool(self.resource_pool_spec[name], self.timeout_s, name=name)

    def get_resource_pool(self, role) -> ResourcePool:
        if role not in self.mapping:
            raise KeyError(f"ResourcePoolManager: no pool for role {role!r}; roles: {list(self.mapping)}")
        if not self.resource_pool_dict:
            self.create_resource_pool()
        return self.resource_pool_dict[self.mapping[role]]

    def roles_on(self, pool_name: str) -> list:
        return [role for role, name in self.mapping.items() if name == pool_name]
