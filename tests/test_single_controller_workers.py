"""Worker classes shared by the single-controller tests (importable by spawned ranks; holds no tests)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tinyzero.protocol import DataProto
from tinyzero.single_controller import (
    Dispatch,
    Execute,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)


def split_by_rank(wg, x):
    """Custom dispatch: worker i gets x * i."""
    return ([x * i for i in range(wg.world_size)],), {}


def sum_outputs(wg, outputs):
    return sum(outputs)


class ModeWorker(Worker):
    """One method per dispatch / execute mode; values depend on the rank so tests can tell who ran."""

    def __init__(self, base: int = 0):
        super().__init__()
        self.value = base + self.rank
        self.calls = 0

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x):
        self.value += x
        return self.value

    @register(Dispatch.ALL_TO_ALL)
    def a2a(self, x, y=None):
        return (self.rank, x, y)

    @register(Dispatch.DP_COMPUTE)
    def dpc(self, x):
        return x * 10 + self.rank

    @register(Dispatch.DP_COMPUTE_PROTO)
    def scale(self, data: DataProto) -> DataProto:
        x = data.batch["x"]
        return DataProto.from_dict(
            {"y": x * (self.rank + 1), "who": torch.full((len(data),), self.rank),
             "flag": x > 1, "half": x.to(torch.bfloat16), "scalar": x[:, 0].double()},
            non_tensors={"id": data.non_tensor_batch["id"]}, meta_info={"from_rank": self.rank})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def keep_even(self, data: DataProto) -> DataProto:
        """Variable-size output: only rows with an even id survive."""
        ids = data.non_tensor_batch["id"]
        keep = [i for i, v in enumerate(ids) if v % 2 == 0]
        return data.select_idxs(keep)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def summary(self, data: DataProto) -> DataProto:
        """No rows, only meta_info (like update_actor's metrics)."""
        return DataProto(meta_info={"metrics": {"rows": len(data), "rank": self.rank}})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def labels(self, data: DataProto) -> DataProto:
        """Non-tensor output only."""
        return DataProto.from_dict(non_tensors={"label": [f"r{self.rank}:{i}" for i in data.non_tensor_batch["id"]]})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def pair(self, a: DataProto, b: DataProto = None) -> DataProto:
        return DataProto.from_dict({"s": a.batch["x"] + b.batch["x"]})

    @register(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": fn(data.batch["x"])})

    @register(Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto):
        return {"rank": self.rank, "rows": len(data), "sum": float(data.batch["x"].double().sum())}

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_zero(self, x):
        self.calls += 1
        return (self.rank, x)

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def zero_proto(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"z": data.batch["x"] + 100}, non_tensors={"id": data.non_tensor_batch["id"]})

    @register(Dispatch.ONE_TO_ALL)
    def own_proto(self, width: int):
        """A DataProto per worker with its own keys and shapes (gathered as a list)."""
        return DataProto.from_dict({f"k{self.rank}": torch.full((self.rank + 1, width + self.rank), self.rank)})

    @register(Dispatch.ONE_TO_ALL)
    def rows_proto(self, width: int):
        """Same keys on every worker, rank + 1 rows each (gathered as tensors, then split)."""
        return DataProto.from_dict({"v": torch.full((self.rank + 1, width), float(self.rank))},
                                   non_tensors={"r": [self.rank] * (self.rank + 1)}, meta_info={"rank": self.rank})

    @register(Dispatch.ONE_TO_ALL)
    def num_calls(self):
        return self.calls

    @register({"dispatch_fn": split_by_rank, "collect_fn": sum_outputs})
    def custom(self, x):
        return x + self.rank

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, pool_rank: int):
        if self.rank == pool_rank:
            raise ValueError(f"boom on pool rank {pool_rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def unpicklable_on(self, pool_rank: int):
        return (lambda: 0) if self.rank == pool_rank else 0

    def ping(self, x=0):
        return (self.rank, x)


class TPWorker(Worker):
    """A (dp, tp) mesh over its pool; ranks of one tp group share a chunk, tp rank 0 collects."""

    def __init__(self, tp: int = 2):
        super().__init__()
        self.mesh = self.device_mesh((self.world_size // tp, tp), ("dp", "tp"))
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self._register_dispatch_collect_info("actor", dp_rank=self.mesh["dp"].get_local_rank(),
                                             is_collect=self.tp_rank == 0)
        self.seen = None

    def _forward(self, data: DataProto) -> DataProto:
        self.seen = data.non_tensor_batch["id"].tolist()
        total = torch.tensor([float(self.global_rank)])
        dist.all_reduce(total, group=self.mesh["tp"].get_group())  # a real collective inside the tp group
        rows = len(data) if self.tp_rank == 0 else 1  # non-collectors' outputs must be ignored
        return DataProto.from_dict({"y": data.batch["x"][:rows] + total,
                                    "who": torch.full((rows,), self.global_rank)})

    @register(Dispatch.DP_COMPUTE_PROTO, mesh_name="actor")
    def tp_forward(self, data: DataProto) -> DataProto:
        return self._forward(data)

    @register(make_nd_compute_dataproto_dispatch_fn("actor"))
    def tp_forward_nd(self, data: DataProto) -> DataProto:
        return self._forward(data)

    @register(Dispatch.DP_COMPUTE_METRIC, mesh_name="actor")
    def tp_metric(self, data: DataProto):
        return (self.global_rank, data.non_tensor_batch["id"].tolist())

    @register(Dispatch.ONE_TO_ALL)
    def last_seen(self):
        return self.seen


class Sleeper(Worker):
    """Records when its work ran, to measure overlap between pools."""

    @register(Dispatch.ONE_TO_ALL)
    def work(self, seconds: float):
        start = time.time()
        time.sleep(seconds)
        return (self.global_rank, start, time.time())

    @register(Dispatch.ONE_TO_ALL)
    def mesh_sum(self):
        """Sum of global ranks over the pool's 1-D mesh and over the (1, n) mesh's tp axis."""
        flat = self.device_mesh()
        grid = self.device_mesh((1, self.world_size), ("dp", "tp"))
        a = torch.tensor([float(self.global_rank)])
        b = a.clone()
        dist.all_reduce(a, group=flat.get_group())
        dist.all_reduce(b, group=grid["tp"].get_group())
        return (float(a), float(b), flat.size(), grid["dp"].size())
