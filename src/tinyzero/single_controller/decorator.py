"""`register`, `Dispatch` and `Execute`: how a worker method's arguments are shared out and
how its outputs come back (veRL's decorator semantics, run SPMD).

Every rank holds the full, replicated arguments, so "dispatch" here is local: a worker
takes its own share (`local_share`) without any communication. Collection is the only
communication and lives in `transport.py`.

Dispatch modes (per worker i of a pool of n, d = data-parallel rank of worker i):

- ONE_TO_ALL: every worker gets the same args; collect returns the list of n outputs.
- ALL_TO_ALL: if every arg is a list/tuple of length n, worker i gets element i, else every
  worker gets the args unchanged; collect returns the list of n outputs.
- DP_COMPUTE: every arg is a list of length dp_size; worker i gets element d; collect returns
  the list of outputs of the collecting workers, in dp order.
- DP_COMPUTE_PROTO: every arg is a DataProto, split into dp_size equal chunks; worker i gets
  chunk d; collect concatenates the collecting workers' DataProto outputs in dp order.
- DP_COMPUTE_PROTO_WITH_FUNC: like DP_COMPUTE_PROTO, but the first arg is a function given
  to every worker unchanged.
- DP_COMPUTE_METRIC: dispatched like DP_COMPUTE_PROTO; collect returns the list of outputs.
- a dict {"dispatch_fn": f, "collect_fn": g}: f(worker_group, *args, **kwargs) returns
  (args, kwargs) whose every value is a list of n per-worker values; g(worker_group, outputs)
  turns the list of n outputs into the result.

Without a mesh name every worker is its own data-parallel rank. With
`register(..., mesh_name="rollout")` the dp rank / collect flag each worker registered with
`Worker._register_dispatch_collect_info("rollout", dp_rank, is_collect)` is used, so ranks of
one tensor-parallel group share a chunk and only one of them contributes to the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

__all__ = [
    "Dispatch",
    "Execute",
    "register",
    "MethodSpec",
    "get_method_spec",
    "make_nd_compute_dataproto_dispatch_fn",
]

MAGIC_ATTR = "__tinyzero_register__"


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_COMPUTE = "dp_compute"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"
    DP_COMPUTE_METRIC = "dp_compute_metric"


class Execute(Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


# Dispatch modes that take a data-parallel share and honour a mesh's collect flags.
DP_MODES = (Dispatch.DP_COMPUTE, Dispatch.DP_COMPUTE_PROTO, Dispatch.DP_COMPUTE_PROTO_WITH_FUNC,
            Dispatch.DP_COMPUTE_METRIC)


@dataclass(frozen=True)
class MethodSpec:
    """What `register` attached to a worker method."""

    dispatch_mode: Dispatch | None
    execute_mode: Execute
    mesh_name: str | None
    dispatch_fn: Callable | None = None
    collect_fn: Callable | None = None


def register(dispatch_mode: Dispatch | dict = Dispatch.ALL_TO_ALL, execute_mode: Execute = Execute.ALL,
             blocking: bool = True, mesh_name: str | None = None, materialize_futures: bool = True):
    """Mark a Worker method as callable through a WorkerGroup.

    `blocking` and `materialize_futures` are accepted for veRL compatibility and ignored: worker
    methods always run at call time on the pool's ranks, and a result only travels to ranks
    outside the pool when it is first used (see WorkerGroup).
    """
    del blocking, materialize_futures  # arguments are always materialized before dispatch
    if isinstance(dispatch_mode, dict):
        missing = {"dispatch_fn", "collect_fn"} - set(dispatch_mode)
        if missing:
            raise ValueError(f"register: a custom dispatch mode needs keys {sorted(missing)}; "
                             "pass {'dispatch_fn': f, 'collect_fn': g}")
        mesh = dispatch_mode.get("mesh_name", mesh_name)
        spec = MethodSpec(None, Execute(execute_mode), mesh,
                          dispatch_mode["dispatch_fn"], dispatch_mode["collect_fn"])
    elif isinstance(dispatch_mode, Dispatch):
        spec = MethodSpec(dispatch_mode, Execute(execute_mode), mesh_name)
    else:
        raise ValueError(f"register: dispatch_mode must be a Dispatch or a dict with dispatch_fn/collect_fn, "
                         f"got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise ValueError(f"register: execute_mode must be Execute.ALL or Execute.RANK_ZERO, got {execute_mode!r}")

    def decorator(fn):
        setattr(fn, MAGIC_ATTR, spec)
        return fn

    return decorator


def get_method_spec(fn) -> MethodSpec | None:
    return getattr(fn, MAGIC_ATTR, None)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict:
    """veRL's helper: DP_COMPUTE_PROTO over the named mesh, as a custom dispatch-mode dict.

    `register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("rollout"))` is the same as
    `register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="rollout")`.
    """
    return {"dispatch_fn": _NdProto(mesh_name), "collect_fn": _NdProto(mesh_name)}


class _NdProto:
    """Marker object recognised by `resolve_spec` (it is never called)."""

    def __init__(self, mesh_name: str):
        self.mesh_name = mesh_name

    def __call__(self, *args, **kwargs):  # pragma: no cover - replaced by the built-in path
        raise RuntimeError("nd dispatch markers are resolved by the WorkerGroup, not called")


def resolve_spec(spec: MethodSpec) -> MethodSpec:
    """Turn veRL's nd-dispatch dict into the built-in DP_COMPUTE_PROTO with a mesh name."""
    if isinstance(spec.dispatch_fn, _NdProto):
        return MethodSpec(Dispatch.DP_COMPUTE_PROTO, spec.execute_mode, spec.dispatch_fn.mesh_name)
    return spec


# ---------------------------------------------------------------------------- local shares
def _is_split_list(v: Any, n: int) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == n


def all_to_all_share(args: tuple, kwargs: dict, index: int, n: int) -> tuple[tuple, dict]:
    """veRL's execute_all rule: split only when every arg is a list of length n."""
    values = list(args) + list(kwargs.values())
    if values and all(_is_split_list(v, n) for v in values):
        return tuple(a[index] for a in args), {k: v[index] for k, v in kwargs.items()}
    return args, kwargs


def dp_compute_share(args: tuple, kwargs: dict, dp_rank: int, dp_size: int, name: str) -> tuple[tuple, dict]:
    for i, v in enumerate(list(args) + list(kwargs.values())):
        if not _is_split_list(v, dp_size):
            raise ValueError(f"{name}: DP_COMPUTE needs every argument to be a list of length dp_size={dp_size}; "
                             f"argument {i} is {type(v).__name__}"
                             + (f" of length {len(v)}" if isinstance(v, (list, tuple)) else ""))
    return tuple(a[dp_rank] for a in args), {k: v[dp_rank] for k, v in kwargs.items()}


def proto_chunk(data, dp_rank: int, dp_size: int, name: str, what: str):
    """Chunk dp_rank of dp_size equal chunks of a DataProto (a view, no copy)."""
    from tinyzero.protocol import DataProto

    if not isinstance(data, DataProto):
        raise TypeError(f"{name}: DP_COMPUTE_PROTO needs DataProto arguments; {what} is {type(data).__name__}")
    n = len(data)
    if n % dp_size:
        raise ValueError(f"{name}: {what} has {n} rows, which do not split into dp_size={dp_size} equal chunks; "
                         f"pad it with tinyzero.protocol.pad_dataproto_to_divisor(data, {dp_size}) and "
                         "unpad the result with unpad_dataproto")
    size = n // dp_size
    return data.slice(dp_rank * size, (dp_rank + 1) * size)


def dp_proto_share(args: tuple, kwargs: dict, dp_rank: int, dp_size: int, name: str,
                   with_func: bool = False) -> tuple[tuple, dict]:
    head: tuple = ()
    if with_func:
        if not args or not callable(args[0]):
            raise TypeError(f"{name}: DP_COMPUTE_PROTO_WITH_FUNC needs a function as the first argument")
        head, args = (args[0],), args[1:]
    out_args = tuple(proto_chunk(a, dp_rank, dp_size, name, f"argument {i}") for i, a in enumerate(args))
    out_kwargs = {k: proto_chunk(v, dp_rank, dp_size, name, f"argument {k!r}") for k, v in kwargs.items()}
    return head + out_args, out_kwargs
