"""WorkerGroup: `wg.method(...)` on every rank, the SPMD emulation of veRL's driver calls.

Every rank runs the same driver and makes the same calls. For `wg.method(*args)`:

1. ranks outside the pool skip at once and get a LazyResult (see future.py);
2. ranks in the pool take their share of the (replicated) arguments by the method's
   Dispatch mode -- no communication;
3. Execute.ALL runs the method on every worker of the pool, Execute.RANK_ZERO on pool rank 0;
4. one small exchange (on the pool's control group, never shared with the workers' own
   collectives) carries every rank's status and output description; a failure on any
   rank raises RemoteWorkerError with that rank's traceback on every rank of the pool (and,
   through the job's store, on the ranks outside it); outputs are then gathered inside the
   pool -- over the pool's process group, which every rank has left by then, so GPU tensors
   reuse the workers' NCCL communicator -- and reach the other ranks when first used.

    pool = ResourcePool(ranks=[0, 1])
    wg = WorkerGroup(resource_pool=pool, cls_with_init=ClassWithInitArgs(MyWorker, lr=1e-3))
    out = wg.compute(batch)            # same value on every rank
"""

from __future__ import annotations

import torch.distributed as dist

from tinyzero.single_controller import decorator as dec
from tinyzero.single_controller.decorator import DP_MODES, Dispatch, Execute, MethodSpec
from tinyzero.single_controller.failure import (
    collective_timeout_s,
    control_store,
    guard,
    is_collective_timeout,
    record_abort,
)
from tinyzero.single_controller.future import LazyResult, flush_pending, materialize, materialize_args
from tinyzero.single_controller.resource_pool import ResourcePool, ensure_distributed
from tinyzero.single_controller.spmd import check_same_call, next_call_seq, spmd_check_enabled
from tinyzero.single_controller.transport import (
    Envelope,
    broadcast_value,
    exchange,
    format_failure,
    gather_protos,
    make_envelope,
    protos_compatible,
    raise_if_failed,
)
from tinyzero.single_controller.worker import _constructing

__all__ = ["ClassWithInitArgs", "WorkerGroup"]

ROLE_ATTR = "__tinyzero_role__"
_RESERVED = {"world_size", "resource_pool", "name", "spawn", "execute_all_sync", "execute_all",
             "execute_rank_zero", "execute_rank_zero_async", "is_local", "worker"}


class ClassWithInitArgs:
    """A worker class plus the arguments to construct it with on every rank of a pool."""

    def __init__(self, cls, *args, **kwargs):
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self):
        return self.cls(*self.args, **self.kwargs)


class WorkerGroup:
    """One role bound to one ResourcePool; every @register'ed method of the role becomes `wg.method`."""

    def __init__(self, resource_pool: ResourcePool | None = None, cls_with_init: ClassWithInitArgs | None = None,
                 name_prefix: str | None = None):
        if cls_with_init is None:
            raise ValueError("WorkerGroup: pass cls_with_init=ClassWithInitArgs(WorkerClass, *args, **kwargs)")
        ensure_distributed()
        pool = resource_pool if resource_pool is not None else ResourcePool()
        self._setup(pool, cls_with_init.cls, name_prefix or cls_with_init.cls.__name__, None)
        seq = next_call_seq()
        label = f"{self.name}.__init__"
        if spmd_check_enabled():
            check_same_call(seq, label, cls_with_init.args, cls_with_init.kwargs)
        if self.is_local:
            error = None
            _constructing.append(pool)
            try:
                self.worker = cls_with_init()
            except Exception:
                error = format_failure(label, dist.get_rank(), self._rank)
                record_abort(error)
            finally:
                _constructing.pop()
            raise_if_failed(exchange(make_envelope(None, error, False), pool.control_group, label), pool.ranks, label)

    def _setup(self, pool: ResourcePool, cls, name: str, worker) -> None:
        self.resource_pool = pool
        self.name = name
        self.worker = worker
        self._cls = cls
        self._layouts: dict = {}
        self._rank = pool.local_rank_of(dist.get_rank()) if pool.is_local else -1
        self._bind_methods(cls)

    @property
    def world_size(self) -> int:
        return self.resource_pool.world_size

    @property
    def is_local(self) -> bool:
        """Whether this process is one of the group's workers."""
        return self._rank >= 0

    def _bind_methods(self, cls) -> None:
        for attr in dir(cls):
            spec = dec.get_method_spec(getattr(cls, attr, None))
            if spec is None:
                continue
            if attr in _RESERVED:
                raise ValueError(f"{cls.__name__}.{attr}: the name is reserved by WorkerGroup; rename the method")
            role = getattr(getattr(cls, attr), ROLE_ATTR, None)
            setattr(self, attr, self._make_method(attr, dec.resolve_spec(spec), role))

    def _make_method(self, attr: str, spec: MethodSpec, role):
        def method(*args, **kwargs):
            return self._call(attr, spec, args, kwargs, role)

        method.__name__ = attr
        method.__doc__ = getattr(getattr(self._cls, attr), "__doc__", None)
        return method

    # ------------------------------------------------------------------ veRL-style generic calls
    def execute_all(self, method_name: str, *args, **kwargs):
        """Run method_name on every worker (list args of length world_size are split); lazy list of outputs."""
        return self._call(method_name, MethodSpec(Dispatch.ALL_TO_ALL, Execute.ALL, None), args, kwargs)

    def execute_all_sync(self, method_name: str, *args, **kwargs) -> list:
        return materialize(self.execute_all(method_name, *args, **kwargs))

    def execute_rank_zero_async(self, method_name: str, *args, **kwargs):
        return self._call(method_name, MethodSpec(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO, None), args, kwargs)

    def execute_rank_zero(self, method_name: str, *args, **kwargs):
        """Run method_name on pool rank 0 only; its output, on every rank."""
        return materialize(self.execute_rank_zero_async(method_name, *args, **kwargs))

    # ------------------------------------------------------------------ the call
    def _call(self, attr: str, spec: MethodSpec, args: tuple, kwargs: dict, role=None):
        seq = next_call_seq()
        label = f"{self.name}.{attr}"
        if spmd_check_enabled():
            check_same_call(seq, label, args, kwargs)
        flush_pending(owner=self)
        args, kwargs = materialize_args(args, kwargs)
        pool = self.resource_pool
        timeout_s = pool.timeout_s if pool.timeout_s is not None else collective_timeout_s()
        if not self.is_local:
            return LazyResult(seq, "recv", None, pool.result_group, label, self, timeout_s, pool.ranks[0])
        src = self._rank == 0 and pool.result_group is not None
        try:
            result = self._run_in_pool(attr, spec, args, kwargs, role, label)
        except BaseException as e:
            if src:
                control_store().set(f"done/{seq}", str(e))
            raise
        if pool.result_group is None:
            return result
        if src:
            control_store().set(f"done/{seq}", "ok")
            return LazyResult(seq, "src", result, pool.result_group, label, self, timeout_s, pool.ranks[0])
        # The same type on every rank, so results passed on to other calls hash alike.
        return LazyResult(seq, "local", result, pool.result_group, label, self, timeout_s, pool.ranks[0])

    def _run_in_pool(self, attr, spec: MethodSpec, args, kwargs, role, label):
        pool, rank, n = self.resource_pool, self._rank, self.world_size
        target = self.worker.worker_dict[role] if role is not None else self.worker
        dp_rank, dp_size, order = self._layout(spec, target, label)
        output, error = None, None
        run = spec.execute_mode is Execute.ALL or rank == 0
        try:
            a, kw = self._share(spec, args, kwargs, rank, n, dp_rank, dp_size, label)
            if run:
                output = getattr(self.worker, attr)(*a, **kw)
        except Exception as e:
            error = format_failure(label, dist.get_rank(), rank)
            if not is_collective_timeout(e):  # a timed-out wait is a peer's failure: not the job's origin
                record_abort(error)
        if spec.execute_mode is Execute.RANK_ZERO:
            envs = exchange(make_envelope(output, error, rank == 0), pool.control_group, label)
            raise_if_failed(envs, pool.ranks, label)
            if envs[0].kind == "proto" and n > 1:
                return broadcast_value(output, 0, pool.process_group, label, header=envs[0])
            return output if rank == 0 else envs[0].value
        contribute = rank in order
        envs = exchange(make_envelope(output, error, contribute), pool.control_group, label)
        raise_if_failed(envs, pool.ranks, label)
        if spec.dispatch_mode in (Dispatch.DP_COMPUTE_PROTO, Dispatch.DP_COMPUTE_PROTO_WITH_FUNC):
            return gather_protos(envs, output, order, pool.process_group, label)
        outputs = self._gather_list(envs, output, order, label)
        if spec.dispatch_mode is None:
            return spec.collect_fn(self, outputs)
        return outputs

    def _gather_list(self, envs: list[Envelope], output, order: list[int], label: str) -> list:
        """Per-rank outputs in `order`; DataProto outputs travel as tensors, the rest inside the envelopes."""
        from tinyzero.protocol import DataProto, TensorBatch

        proto_ranks = [i for i in order if envs[i].kind == "proto"]
        protos = {}
        if proto_ranks and not protos_compatible(envs, proto_ranks):
            # Unlike DataProtos (other keys or shapes per rank) cannot share one gather: pickle them.
            from tinyzero.distributed import get_device

            mine = None
            if envs[self._rank].kind == "proto":  # CPU copies: a pickled CUDA tensor would land on the sender's GPU
                mine = DataProto(batch=output.batch.to("cpu"), non_tensor_batch=output.non_tensor_batch,
                                 meta_info=output.meta_info)
            gathered: list = [None] * self.world_size
            with guard(label):
                dist.all_gather_object(gathered, mine, group=self.resource_pool.control_group)
            for i in proto_ranks:
                on_gpu = any(spec.device_type != "cpu" for spec in envs[i].specs)
                protos[i] = gathered[i].to(get_device()) if on_gpu else gathered[i]
        elif proto_ranks:
            joined = gather_protos(envs, output, proto_ranks, self.resource_pool.process_group, label)
            offset = 0
            for i in proto_ranks:
                non_tensor, meta, rows = envs[i].value
                part = {k: v[offset:offset + rows] for k, v in joined.batch.items()}
                protos[i] = DataProto(batch=TensorBatch(part, batch_size=rows), non_tensor_batch=non_tensor,
                                      meta_info=dict(meta))
                offset += rows
        return [protos[i] if i in protos else envs[i].value for i in order]

    def _layout(self, spec: MethodSpec, worker, label: str) -> tuple[int, int, list[int]]:
        """(dp_rank of this worker, dp_size, pool ranks whose outputs are collected, in dp order)."""
        n = self.world_size
        if spec.dispatch_mode not in DP_MODES or spec.mesh_name is None:
            return self._rank, n, list(range(n))
        key = (id(worker), spec.mesh_name)
        if key not in self._layouts:
            info = worker._dispatch_collect_info.get(spec.mesh_name)
            envs = exchange(Envelope(kind="obj", value=info), self.resource_pool.control_group, label)
            infos = [e.value for e in envs]
            missing = [i for i, v in enumerate(infos) if v is None]
            if missing:
                raise ValueError(f"{label}: pool ranks {missing} did not register mesh {spec.mesh_name!r}; call "
                                 f"self._register_dispatch_collect_info({spec.mesh_name!r}, dp_rank, is_collect) "
                                 "in the worker")
            dp_size = max(d for d, _ in infos) + 1
            collectors = {}
            for i, (d, c) in enumerate(infos):
                if c and d in collectors:
                    raise ValueError(f"{label}: mesh {spec.mesh_name!r} has two collecting ranks "
                                     f"({collectors[d]} and {i}) for dp rank {d}")
                if c:
                    collectors[d] = i
            if sorted(collectors) != list(range(dp_size)):
                raise ValueError(f"{label}: mesh {spec.mesh_name!r} needs exactly one collecting rank per dp rank "
                                 f"0..{dp_size - 1}; registered (dp_rank, is_collect) per pool rank: {infos}")
            self._layouts[key] = ([d for d, _ in infos], dp_size, [collectors[d] for d in range(dp_size)])
        dp_ranks, dp_size, order = self._layouts[key]
        return dp_ranks[self._rank], dp_size, order

    def _share(self, spec: MethodSpec, args, kwargs, rank, n, dp_rank, dp_size, label):
        mode = spec.dispatch_mode
        if mode is None:
            s_args, s_kwargs = spec.dispatch_fn(self, *args, **kwargs)
            for i, v in enumerate(list(s_args) + list(s_kwargs.values())):
                if not isinstance(v, (list, tuple)) or len(v) != n:
                    raise ValueError(f"{label}: dispatch_fn must return per-worker lists of length {n}; "
                                     f"value {i} is {type(v).__name__}")
            return tuple(a[rank] for a in s_args), {k: v[rank] for k, v in s_kwargs.items()}
        if mode is Dispatch.ONE_TO_ALL:
            return args, kwargs
        if mode is Dispatch.ALL_TO_ALL:
            return dec.all_to_all_share(args, kwargs, rank, n)
        if mode is Dispatch.DP_COMPUTE:
            return dec.dp_compute_share(args, kwargs, dp_rank, dp_size, label)
        with_func = mode is Dispatch.DP_COMPUTE_PROTO_WITH_FUNC
        return dec.dp_proto_share(args, kwargs, dp_rank, dp_size, label, with_func=with_func)

    # ------------------------------------------------------------------ colocation
    def spawn(self, prefix_set) -> dict:
        """{role: WorkerGroup} views of a colocated group (see create_colocated_worker_cls)."""
        roles = getattr(self._cls, "_role_classes", None)
        if roles is None:
            raise ValueError(f"spawn: {self._cls.__name__} is not a colocated class; build it with "
                             "create_colocated_worker_cls({role: ClassWithInitArgs(...)})")
        unknown = sorted(set(prefix_set) - set(roles))
        if unknown:
            raise ValueError(f"spawn: roles {unknown} are not in the colocated class (roles: {sorted(roles)})")
        out = {}
        for role in sorted(prefix_set, key=list(roles).index):
            view = WorkerGroup.__new__(WorkerGroup)
            worker = self.worker.worker_dict[role] if self.is_local else None
            view._setup(self.resource_pool, roles[role], role, worker)
            out[role] = view
        return out

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name}, ranks={self.resource_pool.ranks})"
