"""ParallelDims: the one owner of a role's parallel layout over its pool.

    dims = ParallelDims.for_role(pool_size=4, fsdp_size=-1, tp=2, sp=1, section="actor_rollout_ref.actor")
    mesh = dims.build_mesh(worker.device_mesh)      # ("dp_shard", "tp"), dp_replicate first when > 1
    model = load_sharded_model(..., dims.fsdp_mesh(mesh), tp_mesh=dims.tp_mesh(mesh))
    worker._register_dispatch_collect_info("actor", dims.dp_rank(r), dims.is_collect(r))
    rows = dims.rows_per_rank(ppo_mini_batch_size, rollout_n)   # validated, with the setting to change

Degrees (torchtitan's names) for a pool of `world` ranks, `world = dp_replicate x dp_shard x tp`:

- tp: tensor parallelism, the innermost (consecutive) ranks, so a tp group stays inside a node;
- dp_shard: ranks one copy of the parameters is sharded over by FSDP2 (`fsdp_config.fsdp_size`,
  -1 = every rank that is not a tp peer);
- dp_replicate: copies of the sharded model (hybrid sharding, HSDP);
- sp: Ulysses sequence parallelism inside dp_shard: sp consecutive dp_shard ranks hold the same
  samples and split their sequence (FSDP still shards over them, as veRL does).

A pool-local rank r has coordinates t = r % tp, d = (r // tp) % dp_shard, rr = r // (tp x dp_shard),
s = d % sp. Ranks that hold different data number `dp_size = dp_replicate x dp_shard / sp`; rank r
holds chunk `dp_rank(r) = rr x dp_shard / sp + d // sp`, and the rank with t == 0 and s == 0 of each
chunk reports its results (`is_collect`). FSDP averages gradients over `fsdp_size = dp_replicate x
dp_shard` ranks, which is the factor the loss scaling undoes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message names the setting to change."""


@dataclass(frozen=True)
class ParallelDims:
    """One role's degrees over a pool of `world` ranks (see the module docstring for the rank layout)."""

    world: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: int = 1
    section: str = "actor_rollout_ref.actor"
    """Config section the degrees come from; error messages name its settings."""

    def __post_init__(self):
        for name in ("world", "dp_replicate", "dp_shard", "tp", "sp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{self.section}: {name}={getattr(self, name)} must be >= 1")
        if self.dp_replicate * self.dp_shard * self.tp != self.world:
            raise LayoutError(f"{self.section}: dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                              f"tp {self.tp} = {self.dp_replicate * self.dp_shard * self.tp} ranks, but the pool "
                              f"has {self.world}")
        if self.dp_shard % self.sp:
            raise LayoutError(f"{self.section}.ulysses_sequence_parallel_size={self.sp} must divide the "
                              f"{self.dp_shard} ranks a copy of the model is sharded over "
                              f"(pool {self.world} / tensor_model_parallel_size {self.tp}"
                              + (f", fsdp_config.fsdp_size={self.dp_shard}" if self.dp_replicate > 1 else "") + ")")

    @classmethod
    def for_role(cls, pool_size: int, fsdp_size: int = -1, tp: int = 1, sp: int = 1,
                 section: str = "actor_rollout_ref.actor") -> ParallelDims:
        """The layout a role's settings ask for on a pool of `pool_size` ranks, validated."""
        if tp < 1 or pool_size % tp:
            raise LayoutError(f"{section}.tensor_model_parallel_size={tp} must divide the pool size {pool_size}; "
                              f"set it to a divisor of {pool_size}")
        per_copy = pool_size // tp
        if fsdp_size == 0 or fsdp_size < -1:
            raise LayoutError(f"{section}.fsdp_config.fsdp_size={fsdp_size}: use -1 (all ranks) or a positive size")
        shard = per_copy if fsdp_size in (-1, per_copy) else fsdp_size
        if shard > per_copy or per_copy % shard:
            raise LayoutError(f"{section}.fsdp_config.fsdp_size={fsdp_size} must divide the {per_copy} ranks "
                              f"left for data parallelism (pool {pool_size} / tensor_model_parallel_size {tp}); "
                              "set -1 to shard over all of them")
        return cls(world=pool_size, dp_replicate=per_copy // shard, dp_shard=shard, tp=tp, sp=sp, section=section)

    # ------------------------------------------------------------------ sizes and coordinates
    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP2 reduces gradients over (it averages over them)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_size(self) -> int:
        """Ranks that hold different samples."""
        return self.fsdp_size // self.sp

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(dp_replicate, dp_shard, sp, tp) coordinates of pool-local `rank`."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the pool of {self.world}")
        t = rank % self.tp
        d = (rank // self.tp) % self.dp_shard
        return rank // (self.tp * self.dp_shard), d, d % self.sp, t

    def dp_rank(self, rank: int) -> int:
        """The data chunk pool-local `rank` works on."""
        rr, d, _, _ = self.coordinates(rank)
        return rr * (self.dp_shard // self.sp) + d // self.sp

    def is_collect(self, rank: int) -> bool:
        """Whether `rank` reports its chunk's results (one rank per chunk)."""
        _, _, s, t = self.coordinates(rank)
        return s == 0 and t == 0

    # ------------------------------------------------------------------ batch sizes
    def rows_per_rank(self, mini_batch_size: int, n: int = 1, micro_batch_size: int | None = None,
                      dynamic: bool = False) -> int:
        """Rows of one mini-batch each data-parallel rank trains on (veRL: prompts x n / dp_size),
        checked to split evenly (and into whole micro-batches unless the batches are dynamic)."""
        rows = mini_batch_size * n
        if rows % self.dp_size:
            raise LayoutError(f"{self.section}.ppo_mini_batch_size x rollout.n = {rows} rows do not split over "
                              f"{self.dp_size} data-parallel ranks{self._dp_why()}; make "
                              f"{self.section}.ppo_mini_batch_size x rollout.n a multiple of {self.dp_size}")
        per_rank = rows // self.dp_size
        if micro_batch_size is not None and not dynamic and per_rank % micro_batch_size:
            raise LayoutError(f"{self.section}: each data-parallel rank gets {per_rank} rows per mini-batch "
                              f"(ppo_mini_batch_size {mini_batch_size} x n {n} / {self.dp_size} ranks), not a "
                              f"multiple of ppo_micro_batch_size_per_gpu={micro_batch_size}; set "
                              f"ppo_micro_batch_size_per_gpu to a divisor of {per_rank}")
        return per_rank

    def check_rows(self, rows: int, what: str, setting: str) -> None:
        """`rows` (a whole batch) must split evenly over the data-parallel ranks."""
        if rows % self.dp_size:
            raise LayoutError(f"{what} = {rows} do not split evenly over the {self.dp_size} data-parallel ranks of "
                              f"{self.section}{self._dp_why()}; make {setting} a multiple of {self.dp_size}")

    def _dp_why(self) -> str:
        if self.tp == 1 and self.sp == 1:
            return ""
        return f" (pool {self.world} / tp {self.tp} / sp {self.sp})"

    # ------------------------------------------------------------------ meshes
    def mesh_layout(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(shape, names) of the model's mesh: ("dp_replicate",) only when > 1, "dp_shard", "tp" only when > 1."""
        dims = [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp)]
        kept = [(n, s) for n, s in dims if s > 1 or n == "dp_shard"]
        return tuple(s for _, s in kept), tuple(n for n, _ in kept)

    def data_layout(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(shape, names) of the data mesh ("dp", "sp", "tp"): the same ranks seen as data chunks."""
        return (self.dp_size, self.sp, self.tp), ("dp", "sp", "tp")

    def build_mesh(self, make: Callable):
        """The model's DeviceMesh, from `make(shape, names)` (a worker's `device_mesh`, or init_device_mesh)."""
        return make(*self.mesh_layout())

    def fsdp_mesh(self, mesh):
        """The (sub-)mesh FSDP2 shards and replicates over."""
        names = tuple(n for n in mesh.mesh_dim_names if n != "tp")
        return mesh if names == tuple(mesh.mesh_dim_names) else mesh[names]

    def tp_mesh(self, mesh):
        """The tensor-parallel sub-mesh, or None without tensor parallelism."""
        return mesh["tp"] if self.tp > 1 else None

    def sp_group(self, make: Callable):
        """The process group of the ranks that split one sample's sequence (None when sp == 1)."""
        if self.sp == 1:
            return None
        return make(*self.data_layout())["sp"].get_group()

    def dp_group(self, make: Callable, pool_group):
        """The process group of the ranks that hold different samples (token counts and batch statistics
        reduce over it: a tp or sp peer holds the same samples and would count them twice)."""
        if self.dp_size == self.world:
            return pool_group
        return make(*self.data_layout())["dp"].get_group()

