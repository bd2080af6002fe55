"""Lazy results: what `wg.method(...)` returns when its pool is not the whole world.

The pool's ranks compute and gather at call time; the ranks outside skip at once. Every rank
gets a `LazyResult` (in the pool it already holds the value). The result crosses to the
others (a broadcast from the pool's first rank over the pool's result group) only when it is
first used: reading an attribute, indexing, `len`,
`isinstance`, passing it to another WorkerGroup call, or `materialize(x)`. So the driver

    values = critic_wg.compute_values(batch)        # ranks 4-7 compute, 0-3 skip
    log_probs = actor_wg.compute_log_prob(batch)    # ranks 0-3 compute, 4-7 skip
    batch = batch.union(values).union(log_probs)    # results cross here

runs the critic and the actor at the same time.

Transfers happen in call order on every rank: using a result first delivers every older
pending one, and calling a WorkerGroup delivers that group's older results, so the
collectives always line up and unused results never pile up.
"""

from __future__ import annotations

import operator

import torch.distributed as dist

from tinyzero.single_controller.failure import RemoteWorkerError, control_store, wait_for_key
from tinyzero.single_controller.spmd import check_delivery, spmd_check_enabled
from tinyzero.single_controller.transport import broadcast_value

__all__ = ["LazyResult", "materialize", "flush_pending", "materialize_args"]

_pending: list[LazyResult] = []


def _done_key(seq: int) -> str:
    return f"done/{seq}"


def _release(key: str, readers: int) -> None:
    """The last of `readers` ranks to read a status key deletes it, so keys do not pile up."""
    store = control_store()
    try:
        if store.add(f"{key}/reads", 1) == readers:
            store.delete_key(key)
            store.delete_key(f"{key}/reads")
    except Exception:  # noqa: BLE001 - cleanup only
        pass


class LazyResult:
    """A transparent proxy for a result that reaches this rank on first use."""

    __slots__ = ("_lz_seq", "_lz_role", "_lz_value", "_lz_ready", "_lz_group", "_lz_label", "_lz_owner",
                 "_lz_timeout", "_lz_error", "_lz_src", "__weakref__")

    def __init__(self, seq: int, role: str, value, group, label: str, owner, timeout_s: float, src: int):
        object.__setattr__(self, "_lz_seq", seq)
        object.__setattr__(self, "_lz_role", role)  # "src" (sends), "recv" (receives), "local" (has it)
        object.__setattr__(self, "_lz_value", value)
        object.__setattr__(self, "_lz_ready", role == "local")
        object.__setattr__(self, "_lz_group", group)
        object.__setattr__(self, "_lz_label", label)
        object.__setattr__(self, "_lz_owner", owner)
        object.__setattr__(self, "_lz_timeout", timeout_s)
        object.__setattr__(self, "_lz_error", None)
        object.__setattr__(self, "_lz_src", src)  # global rank that sends
        if role != "local":
            _pending.append(self)

    # ------------------------------------------------------------------ delivery
    def _lz_deliver(self) -> None:
        group, label = self._lz_group, self._lz_label
        src_index = dist.get_group_rank(group, self._lz_src)
        if spmd_check_enabled():
            check_delivery(self._lz_seq, label, dist.get_process_group_ranks(group))
        if self._lz_role == "src":
            value = broadcast_value(self._lz_value, src_index, group, label)
        else:
            key = _done_key(self._lz_seq)
            status = wait_for_key(key, self._lz_timeout, label).decode(errors="replace")
            _release(key, dist.get_world_size(group) - 1)
            if status != "ok":
                raise RemoteWorkerError(f"rank {dist.get_rank()}: {label} failed on its pool:\n{status}",
                                        remote_traceback=status)
            value = broadcast_value(None, src_index, group, label)
        object.__setattr__(self, "_lz_value", value)
        object.__setattr__(self, "_lz_ready", True)

    def _lz_get(self):
        if not self._lz_ready:
            if self._lz_error is not None:
                raise self._lz_error
            flush_pending(upto=self._lz_seq)
        return self._lz_value

    # ------------------------------------------------------------------ transparency
    @property
    def __class__(self):  # isinstance(x, DataProto) works and delivers the value
        return type(self._lz_get())

    def __getattr__(self, name):
        return getattr(self._lz_get(), name)

    def __setattr__(self, name, value):
        setattr(self._lz_get(), name, value)

    def __dir__(self):
        return dir(self._lz_get())

    def __repr__(self):
        return repr(self._lz_get()) if self._lz_ready else f"<LazyResult of {self._lz_label}, not yet delivered>"

    def __str__(self):
        return str(self._lz_get())

    def __reduce_ex__(self, protocol):
        return self._lz_get().__reduce_ex__(protocol)

    def __len__(self):
        return len(self._lz_get())

    def __iter__(self):
        return iter(self._lz_get())

    def __bool__(self):
        return bool(self._lz_get())

    def __hash__(self):
        return hash(self._lz_get())

    def __contains__(self, item):
        return item in self._lz_get()

    def __getitem__(self, key):
        return self._lz_get()[key]

    def __setitem__(self, key, value):
        self._lz_get()[key] = value

    def __delitem__(self, key):
        del self._lz_get()[key]

    def __float__(self):
        return float(self._lz_get())

    def __int__(self):
        return int(self._lz_get())

    def __index__(self):
        return operator.index(self._lz_get())


def _binary(op):
    def forward(self, other):
        return op(self._lz_get(), materialize(other))

    def backward(self, other):
        return op(materialize(other), self._lz_get())

    return forward, backward


for _name, _op in [("eq", operator.eq), ("ne", operator.ne), ("lt", operator.lt), ("le", operator.le),
                   ("gt", operator.gt), ("ge", operator.ge)]:
    setattr(LazyResult, f"__{_name}__", _binary(_op)[0])
for _name, _op in [("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
                   ("pow", operator.pow), ("and", operator.and_), ("or", operator.or_)]:
    _f, _b = _binary(_op)
    setattr(LazyResult, f"__{_name}__", _f)
    setattr(LazyResult, f"__r{_name}__", _b)


def flush_pending(upto: int | None = None, owner=None) -> None:
    """Deliver pending results in call order: all up to call #upto, or up to owner's newest."""
    if owner is not None:
        seqs = [p._lz_seq for p in _pending if p._lz_owner is owner]
        if not seqs:
            return
        upto = max(seqs)
    while _pending and (upto is None or _pending[0]._lz_seq <= upto):
        head = _pending.pop(0)
        try:
            head._lz_deliver()
        except BaseException as e:
            object.__setattr__(head, "_lz_error", e)
            raise


def materialize(x):
    """The plain value behind x (x itself when it is not a LazyResult)."""
    if type(x) is LazyResult:
        return x._lz_get()
    return x


def materialize_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Replace LazyResults in the arguments (top level and inside lists / tuples / dicts)."""

    def one(v):
        if type(v) is LazyResult:
            return v._lz_get()
        if type(v) in (list, tuple):
            return type(v)(one(x) for x in v)
        if type(v) is dict:
            return {k: one(x) for k, x in v.items()}
        return v

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}
