"""Single-controller tests on CPU gloo ranks: every dispatch / execute mode, subset pools,
lazy results, tensor-parallel meshes, overlap of disjoint pools, colocation, failures.

Each scenario runs inside `run_distributed` and asserts on every rank against a reference
computed in plain Python from the same inputs (exact equality: the layer only moves data).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def _init():
    from tinyzero.distributed import init_distributed

    init_distributed(timeout_s=120)
    torch.manual_seed(0)


def _batch(rows: int, cols: int = 3):
    from tinyzero.protocol import DataProto

    x = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 7
    return DataProto.from_dict({"x": x}, non_tensors={"id": list(range(rows))}, meta_info={"temperature": 0.5})


# ---------------------------------------------------------------------------- one rank
def _single_rank():
    from tests.test_single_controller_workers import ModeWorker
    from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup

    _init()
    wg = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=ClassWithInitArgs(ModeWorker, base=3))
    assert wg.world_size == 1
    assert wg.add(x=10) == [13]
    data = _batch(4)
    out = wg.scale(data)
    assert torch.equal(out.batch["y"], data.batch["x"])
    assert out.non_tensor_batch["id"].tolist() == [0, 1, 2, 3]
    assert wg.only_zero(5) == (0, 5)
    assert wg.custom(4) == 0

    # user errors name the fix
    from tests.test_single_controller_workers import TPWorker
    from tinyzero.single_controller import RemoteWorkerError, ResourcePoolManager

    with pytest.raises(ValueError, match="outside the world of 1 ranks"):
        ResourcePool(ranks=[1])
    with pytest.raises(ValueError, match="duplicates"):
        ResourcePool(ranks=[0, 0])
    with pytest.raises(ValueError, match="undefined pools"):
        ResourcePoolManager({"a": [0]}, {"critic": "b"})
    with pytest.raises(RemoteWorkerError, match="list of length dp_size=1"):
        wg.dpc(3)
    with pytest.raises(RemoteWorkerError, match="DP_COMPUTE_PROTO needs DataProto arguments"):
        wg.scale([1, 2])
    with pytest.raises(ValueError, match="not a colocated class"):
        wg.spawn(prefix_set={"actor"})
    tp = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=ClassWithInitArgs(TPWorker, tp=1))
    assert torch.equal(tp.tp_forward(data).batch["y"], data.batch["x"])  # rank 0 alone: + 0
    tp.worker._dispatch_collect_info.clear()
    tp._layouts.clear()
    with pytest.raises(ValueError, match="did not register mesh 'actor'"):
        tp.tp_forward(data)

    # a worker built directly (no WorkerGroup) lives on the whole world
    w = ModeWorker(base=1)
    assert (w.rank, w.world_size, w.add(2)) == (0, 1, 3)
    return True


def test_register_rejects_bad_modes():
    from tinyzero.single_controller import Execute, register

    with pytest.raises(ValueError, match="dispatch_fn"):
        register({"collect_fn": len})
    with pytest.raises(ValueError, match="dispatch_mode must be"):
        register("one_to_all")
    with pytest.raises(ValueError, match="execute_mode"):
        register(execute_mode="all")
    assert register(execute_mode=Execute.RANK_ZERO)(lambda self: 1).__tinyzero_register__.execute_mode is Execute.RANK_ZERO


def test_single_rank():
    assert run_distributed(_single_rank, 1, timeout=120) == [True]


# ---------------------------------------------------------------------------- two ranks
def _two_rank_modes():
    from tests.test_single_controller_workers import ModeWorker
    from tinyzero.protocol import DataProto
    from tinyzero.single_controller import (
        ClassWithInitArgs,
        LazyResult,
        RemoteWorkerError,
        ResourcePool,
        WorkerGroup,
        materialize,
    )

    _init()
    wg = WorkerGroup(resource_pool=ResourcePool(ranks=[0, 1]), cls_with_init=ClassWithInitArgs(ModeWorker, base=5))
    assert wg.world_size == 2

    # the accumulator example: every worker's value comes back
    assert wg.add(x=10) == [15, 16]
    assert wg.add(1) == [16, 17]

    # ALL_TO_ALL splits list args of length world_size, passes anything else unchanged
    assert wg.a2a([7, 8], y=["p", "q"]) == [(0, 7, "p"), (1, 8, "q")]
    assert wg.a2a(3, y="z") == [(0, 3, "z"), (1, 3, "z")]

    # DP_COMPUTE: element i to worker i
    assert wg.dpc([1, 2]) == [10, 21]

    # DP_COMPUTE_PROTO: chunk i to worker i, outputs concatenated in order
    data = _batch(6)
    out = wg.scale(data)
    x = data.batch["x"]
    assert isinstance(out, DataProto) and len(out) == 6
    assert torch.equal(out.batch["y"], torch.cat([x[:3] * 1, x[3:] * 2]))
    assert out.batch["who"].tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(out.batch["flag"], x > 1) and torch.equal(out.batch["half"], x.to(torch.bfloat16))
    assert torch.equal(out.batch["scalar"], x[:, 0].double())  # 1-D, float64
    assert out.non_tensor_batch["id"].tolist() == list(range(6))
    assert out.meta_info == {"from_rank": 0}  # concat keeps the first chunk's meta_info
    summary = wg.summary(data)
    assert len(summary) == 0 and summary.meta_info == {"metrics": {"rows": 3, "rank": 0}}
    assert wg.labels(data).non_tensor_batch["label"].tolist() == ["r0:0", "r0:1", "r0:2", "r1:3", "r1:4", "r1:5"]
    s = wg.pair(data, b=data)
    assert torch.equal(s.batch["s"], 2 * x)

    # variable-size outputs (padded gather)
    kept = wg.keep_even(_batch(8))
    assert kept.non_tensor_batch["id"].tolist() == [0, 2, 4, 6]
    assert torch.equal(kept.batch["x"], _batch(8).batch["x"][[0, 2, 4, 6]])

    # a batch that does not split evenly fails on every rank with the fix in the message
    with pytest.raises(RemoteWorkerError, match="pad_dataproto_to_divisor"):
        wg.scale(_batch(5))

    # DP_COMPUTE_PROTO_WITH_FUNC and DP_COMPUTE_METRIC
    assert torch.equal(wg.apply(torch.square, data).batch["y"], x**2)
    metrics = wg.metric(data)
    assert metrics == [{"rank": 0, "rows": 3, "sum": float(x[:3].double().sum())},
                       {"rank": 1, "rows": 3, "sum": float(x[3:].double().sum())}]

    # ONE_TO_ALL DataProto outputs come back as a list, also when their keys and shapes differ
    protos = wg.own_proto(2)
    assert [sorted(p.batch) for p in protos] == [["k0"], ["k1"]]
    assert torch.equal(protos[1].batch["k1"], torch.full((2, 3), 1))

    same = wg.rows_proto(4)
    assert [len(p) for p in same] == [1, 2] and [p.meta_info["rank"] for p in same] == [0, 1]
    assert torch.equal(same[1].batch["v"], torch.ones(2, 4)) and same[1].non_tensor_batch["r"].tolist() == [1, 1]

    # Execute.RANK_ZERO runs on pool rank 0 only, every rank gets its output
    assert wg.only_zero(4) == (0, 4)
    assert wg.num_calls() == [1, 0]
    z = wg.zero_proto(data)
    assert torch.equal(z.batch["z"], x + 100) and z.non_tensor_batch["id"].tolist() == list(range(6))

    # custom dispatch / collect: worker i gets 3 * i and returns 3 * i + i
    assert wg.custom(3) == (0 + 0) + (3 + 1)

    # veRL-style generic calls, also on unregistered methods
    assert wg.execute_all_sync("ping", [1, 2]) == [(0, 1), (1, 2)]
    assert wg.execute_all_sync("ping", x=9) == [(0, 9), (1, 9)]
    assert wg.execute_rank_zero("ping", 7) == (0, 7)

    # a pool on rank 1 only: rank 0 skips and receives the result lazily
    rank = torch.distributed.get_rank()
    sub = WorkerGroup(resource_pool=ResourcePool(ranks=[1]), cls_with_init=ClassWithInitArgs(ModeWorker, base=100))
    assert sub.world_size == 1
    f = sub.add(x=1)
    if rank == 0:
        assert type(f) is LazyResult
    assert materialize(f) == [101]
    g = sub.scale(data)
    assert isinstance(g, DataProto)  # isinstance works through the lazy proxy
    assert torch.equal(g.batch["y"], x) and g.non_tensor_batch["id"].tolist() == list(range(6))
    z = sub.zero_proto(data)  # Execute.RANK_ZERO DataProto result reaching the rank outside
    assert torch.equal(z.batch["z"], x + 100) and z.non_tensor_batch["id"].tolist() == list(range(6))
    unused = sub.add(x=1)  # never used: delivered by the next call to `sub`
    del unused
    assert sub.add(x=1) == [103]
    assert wg.add(0) == [16, 17]  # a lazy argument passed to another group is delivered first
    assert wg.a2a(sub.add(x=0), y=None)[0] == (0, [103], None)

    # a worker that raises: every rank gets its traceback, and the job can go on
    with pytest.raises(RemoteWorkerError) as info:
        wg.fail_on(1)
    assert info.value.rank == 1
    assert "ValueError: boom on pool rank 1" in str(info.value) and "in fail_on" in str(info.value)
    assert wg.add(0) == [16, 17]
    with pytest.raises(RemoteWorkerError, match="cannot be sent to the other ranks"):
        wg.unpicklable_on(1)

    # ... also when it happens on a pool this rank is not in
    f = None
    try:
        f = sub.fail_on(0)
        materialize(f)
    except RemoteWorkerError as e:
        assert "ValueError: boom on pool rank 0" in str(e)
    else:
        raise AssertionError("the failure in the sub-pool was not reported")
    return rank


def test_dispatch_and_execute_modes_two_ranks():
    assert run_distributed(_two_rank_modes, 2, timeout=240) == [0, 1]


# ---------------------------------------------------------------------------- four ranks
def _four_ranks():
    import torch.distributed as dist

    from tests.test_single_controller_workers import ModeWorker, Sleeper, TPWorker
    from tinyzero.single_controller import (
        ClassWithInitArgs,
        ResourcePool,
        ResourcePoolManager,
        WorkerGroup,
        create_colocated_worker_cls,
        materialize,
    )

    _init()
    rank = dist.get_rank()
    data = _batch(8)
    x = data.batch["x"]
    # dp 0 = ranks {0, 1} (rows 0-3, tp-sum 0+1), dp 1 = ranks {2, 3} (rows 4-7, tp-sum 2+3)
    expect_y = torch.cat([x[:4] + 1, x[4:] + 5])
    expect_who = [0] * 4 + [2] * 4

    # tensor-parallel dispatch: one chunk per tp group, only tp rank 0 contributes
    tp = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=ClassWithInitArgs(TPWorker, tp=2))
    for method in (tp.tp_forward, tp.tp_forward_nd):
        out = method(data)
        assert torch.equal(out.batch["y"], expect_y), out.batch["y"]
        assert out.batch["who"].tolist() == expect_who
    assert tp.last_seen() == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    assert tp.tp_metric(data) == [(0, [0, 1, 2, 3]), (2, [4, 5, 6, 7])]

    # two disjoint pools from a manager; their work overlaps in time
    manager = ResourcePoolManager({"actor": [0, 1], "critic": [2, 3]}, {"actor_rollout": "actor", "critic": "critic"})
    a = WorkerGroup(manager.get_resource_pool("actor_rollout"), ClassWithInitArgs(Sleeper))
    b = WorkerGroup(manager.get_resource_pool("critic"), ClassWithInitArgs(Sleeper))
    seconds = 1.5
    fa = a.work(seconds)
    fb = b.work(seconds)
    ra, rb = materialize(fa), materialize(fb)
    assert [r[0] for r in ra] == [0, 1] and [r[0] for r in rb] == [2, 3]
    a_start, a_end = min(r[1] for r in ra), max(r[2] for r in ra)
    b_start, b_end = min(r[1] for r in rb), max(r[2] for r in rb)
    overlap = min(a_end, b_end) - max(a_start, b_start)
    assert overlap > 0.6 * seconds, f"pools ran one after the other: overlap {overlap:.2f} s"

    # meshes on a pool that is a subset of the world
    sums = b.mesh_sum()
    assert sums == [(5.0, 5.0, 2, 1), (5.0, 5.0, 2, 1)]
    # tensor parallelism on that subset: one dp rank, rank 2 collects, ranks 0 and 1 receive
    tpb = WorkerGroup(manager.get_resource_pool("critic"), ClassWithInitArgs(TPWorker, tp=2))
    out = tpb.tp_forward(data)
    assert torch.equal(out.batch["y"], x + 5) and out.batch["who"].tolist() == [2] * 8

    # colocated roles on one pool, with the tp role's mesh dispatch still honoured
    cls = create_colocated_worker_cls({"actor": ClassWithInitArgs(ModeWorker, base=100),
                                       "critic": ClassWithInitArgs(TPWorker, tp=2)})
    co = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=cls)
    wgs = co.spawn(prefix_set={"actor", "critic"})
    assert sorted(wgs) == ["actor", "critic"]
    assert wgs["actor"].add(x=1) == [101, 102, 103, 104]
    assert co.actor_add(1) == [102, 103, 104, 105]  # same worker objects behind both names
    assert torch.equal(wgs["critic"].tp_forward(data).batch["y"], expect_y)
    assert torch.equal(co.critic_tp_forward(data).batch["y"], expect_y)
    assert wgs["actor"].scale(data).batch["who"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    return rank


@pytest.mark.slow
def test_four_ranks_tp_overlap_colocation():
    assert run_distributed(_four_ranks, 4, timeout=300) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------- divergence
def _divergence():
    import torch.distributed as dist

    from tests.test_single_controller_workers import ModeWorker
    from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, SPMDDivergenceError, WorkerGroup

    _init()
    rank = dist.get_rank()
    wg = WorkerGroup(resource_pool=ResourcePool(), cls_with_init=ClassWithInitArgs(ModeWorker))
    assert wg.add(x=1) == [1, 2]  # identical calls pass the check
    sub = WorkerGroup(resource_pool=ResourcePool(ranks=[1]), cls_with_init=ClassWithInitArgs(ModeWorker))
    lazy = sub.add(x=1)  # a result still in flight hashes alike on every rank
    assert wg.a2a(lazy, y=None) == [(0, [1], None), (1, [1], None)]
    caught = {}
    for kind in ("args", "method", "missing"):
        try:
            if kind == "args":  # rank 1 passes a different value
                wg.add(x=1 if rank != 1 else 2)
            elif kind == "method":  # rank 1 calls another method
                wg.add(x=0) if rank != 1 else wg.dpc([0, 0])
            elif rank != 1:  # rank 1 skips the call entirely
                wg.add(x=0)
            caught[kind] = "no error" if rank != 1 or kind != "missing" else "skipped"
        except SPMDDivergenceError as e:
            caught[kind] = (e.rank, str(e))
    return caught


@pytest.mark.slow
def test_spmd_divergence_is_detected():
    env = {"TINYZERO_CHECK_SPMD": "1", "TINYZERO_CHECK_SPMD_TIMEOUT_S": "4"}
    results = run_distributed(_divergence, 2, timeout=120, env=env)
    assert results[1]["missing"] == "skipped"
    for rank, caught in enumerate(results):
        for kind in ("args", "method", "missing"):
            if rank == 1 and kind == "missing":
                continue
            first_rank, message = caught[kind]
            assert first_rank == 1, message
            assert "first divergent rank" in message, message
    assert "rank(s) [1] did not make" in results[0]["missing"][1]
    assert "dpc" in results[0]["method"][1] and "add" in results[0]["method"][1]


def _rank_dependent_use():
    import torch.distributed as dist

    from tests.test_single_controller_workers import ModeWorker
    from tinyzero.single_controller import (
        ClassWithInitArgs,
        ResourcePool,
        SPMDDivergenceError,
        WorkerGroup,
        materialize,
    )

    _init()
    sub = WorkerGroup(resource_pool=ResourcePool(ranks=[1]), cls_with_init=ClassWithInitArgs(ModeWorker))
    result = sub.add(x=1)
    if dist.get_rank() == 0:  # only rank 0 looks at the result: rank 1 (the sender) never follows
        try:
            materialize(result)
        except SPMDDivergenceError as e:
            return (e.rank, str(e))
        return "no error"
    return "did not use it"


@pytest.mark.slow
def test_rank_dependent_use_of_a_result_is_detected():
    env = {"TINYZERO_CHECK_SPMD": "1", "TINYZERO_CHECK_SPMD_TIMEOUT_S": "3"}
    results = run_distributed(_rank_dependent_use, 2, timeout=120, env=env)
    assert results[1] == "did not use it"
    first_rank, message = results[0]
    assert first_rank == 1 and "did not within" in message and "ModeWorker.add" in message, message


def test_docs_point_to_files_the_project_has():
    """Every *.md a source docstring or comment names exists in the repository."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sources = [p for d in ("src", "kernels", "configs", "bench") for p in (root / d).rglob("*.py")]
    sources.append(root / "train.py")
    missing = []
    for path in sources:
        for name in re.findall(r"[\w./-]+\.md\b", path.read_text()):
            if not any((root / base / name).exists() for base in (".", "docs")):
                missing.append(f"{path.relative_to(root)}: {name}")
    assert not missing, missing
