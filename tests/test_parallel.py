"""ParallelDims: rank coordinates against a plain loop over the layout, batch checks, model checks,
and the meshes it builds over a real gloo world (4 processes)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from tinyzero.distributed.parallel_dims import LayoutError, ParallelDims
from tinyzero.single_controller import Dispatch, Worker, register
from tinyzero.workers.config import ActorConfig, CriticConfig


def _reference_layout(dp_replicate, dp_shard, tp, sp):
    """rank -> (dp chunk, collects?) by enumerating the nested loops of the documented order."""
    out, rank = {}, 0
    for rr, d, t in itertools.product(range(dp_replicate), range(dp_shard), range(tp)):
        out[rank] = (rr * (dp_shard // sp) + d // sp, d % sp == 0 and t == 0)
        rank += 1
    return out


@pytest.mark.parametrize("world,fsdp_size,tp,sp", [(1, -1, 1, 1), (4, -1, 1, 1), (4, 2, 1, 1), (4, -1, 2, 1),
                                                    (4, -1, 1, 2), (4, -1, 2, 2), (8, 2, 2, 2), (8, 4, 1, 2)])
def test_coordinates_match_plain_loop(world, fsdp_size, tp, sp):
    dims = ParallelDims.for_role(world, fsdp_size, tp=tp, sp=sp)
    assert dims.dp_replicate * dims.dp_shard * dims.tp == world
    ref = _reference_layout(dims.dp_replicate, dims.dp_shard, tp, sp)
    assert {r: (dims.dp_rank(r), dims.is_collect(r)) for r in range(world)} == ref
    # Every chunk has exactly one reporting rank and dp_size chunks exist.
    chunks = [dims.dp_rank(r) for r in range(world) if dims.is_collect(r)]
    assert sorted(chunks) == list(range(dims.dp_size))
    assert dims.fsdp_size == world // tp and dims.dp_size == world // (tp * sp)


def test_fsdp_size_gives_hybrid_sharding_and_names():
    dims = ParallelDims.for_role(8, 2, tp=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 2, 2)
    assert dims.mesh_layout() == ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
    assert ParallelDims.for_role(4).mesh_layout() == ((4,), ("dp_shard",))
    assert ParallelDims.for_role(4, 2).mesh_layout() == ((2, 2), ("dp_replicate", "dp_shard"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(pool_size=4, tp=3), "tensor_model_parallel_size=3 must divide the pool size 4"),
    (dict(pool_size=4, fsdp_size=3), "fsdp_size=3 must divide the 4 ranks"),
    (dict(pool_size=4, tp=2, fsdp_size=4), "fsdp_size=4 must divide the 2 ranks"),
    (dict(pool_size=4, sp=3), "ulysses_sequence_parallel_size=3 must divide"),
    (dict(pool_size=4, fsdp_size=0), "fsdp_size=0"),
])
def test_layout_errors_name_the_setting(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        ParallelDims.for_role(section="critic", **kwargs)


def test_rows_per_rank_and_messages():
    dims = ParallelDims.for_role(4, tp=2)  # 2 data-parallel ranks
    assert dims.rows_per_rank(3, 2) == 3
    with pytest.raises(LayoutError, match="do not split over 2 data-parallel ranks"):
        dims.rows_per_rank(3, 1)
    with pytest.raises(LayoutError, match="divisor of 3"):
        dims.rows_per_rank(3, 2, micro_batch_size=2)
    assert dims.rows_per_rank(3, 2, micro_batch_size=2, dynamic=True) == 3
    with pytest.raises(LayoutError, match="make data.train_batch_size a multiple of 2"):
        dims.check_rows(5, "data.train_batch_size", "data.train_batch_size")


def test_role_sections_build_their_dims():
    actor = ActorConfig()
    actor.fsdp_config.fsdp_size = 2
    dims = actor.parallel_dims(4)
    assert (dims.dp_replicate, dims.dp_shard, dims.section) == (2, 2, "actor_rollout_ref.actor")
    with pytest.raises(LayoutError, match=r"critic.fsdp_config.fsdp_size=3"):
        critic = CriticConfig()
        critic.fsdp_config.fsdp_size = 3
        critic.parallel_dims(4)


# --------------------------------------------------------------------------- meshes over a real world


class LayoutWorker(Worker):
    """Builds each layout's meshes over its pool and reports their groups as global rank lists."""

    @register(Dispatch.ONE_TO_ALL)
    def groups(self):
        import torch.distributed as dist

        def ranks(mesh):
            return dist.get_process_group_ranks(mesh.get_group())

        tp2 = ParallelDims.for_role(self.world_size, tp=2)
        mesh = tp2.build_mesh(self.device_mesh)
        hsdp = ParallelDims.for_role(self.world_size, 2)
        hsdp_mesh = hsdp.build_mesh(self.device_mesh)
        sp2 = ParallelDims.for_role(self.world_size, sp=2)
        return {"tp2_fsdp": ranks(tp2.fsdp_mesh(mesh)), "tp2_tp": ranks(tp2.tp_mesh(mesh)),
                "hsdp_replicate": ranks(hsdp_mesh["dp_replicate"]), "hsdp_shard": ranks(hsdp_mesh["dp_shard"]),
                "sp2_sp": dist.get_process_group_ranks(sp2.sp_group(self.device_mesh)),
                "sp2_fsdp": ranks(sp2.fsdp_mesh(sp2.build_mesh(self.device_mesh))),
                "sp2_dp_rank": sp2.dp_rank(self.rank)}


def _meshes_on_pool():
    """On 5 gloo ranks, a pool of ranks 1..4: each pool rank's groups, as the controller code on rank 0 sees them."""
    import torch.distributed as dist

    from tinyzero.distributed import init_distributed
    from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup, materialize

    init_distributed()
    wg = WorkerGroup(resource_pool=ResourcePool(ranks=[1, 2, 3, 4]), cls_with_init=ClassWithInitArgs(LayoutWorker))
    out = materialize(wg.groups())  # results reach ranks outside the pool when read
    dist.barrier()
    return out if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_meshes_over_a_pool_subset():
    from tests.dist_utils import run_distributed

    out = [None] + run_distributed(_meshes_on_pool, 5, timeout=120)[0]  # as seen from rank 0, outside the pool
    pairs, strided = {1: [1, 2], 2: [1, 2], 3: [3, 4], 4: [3, 4]}, {1: [1, 3], 3: [1, 3], 2: [2, 4], 4: [2, 4]}
    for rank in range(1, 5):  # pool index = global rank - 1; the innermost axis holds consecutive ranks
        got = out[rank]
        assert got["tp2_tp"] == pairs[rank] and got["tp2_fsdp"] == strided[rank]
        assert got["hsdp_shard"] == pairs[rank] and got["hsdp_replicate"] == strided[rank]
        assert got["sp2_sp"] == pairs[rank] and got["sp2_fsdp"] == [1, 2, 3, 4]
        assert got["sp2_dp_rank"] == (rank - 1) // 2


def test_model_layouts_are_checked_before_anything_starts():
    """Start-up check (the run plan against the model, tinyzero.plan.with_model): heads / sizes that tp or sp
    cannot split."""
    from tinyzero.config import Config, ConfigError
    from tinyzero.config.parse import merge_dict
    from tinyzero.plan import plan_run, with_model

    def check_model_layouts(cfg, world_size, hf_config):
        with_model(plan_run(cfg, world_size, notice=None), hf_config)

    hf = SimpleNamespace(num_attention_heads=6, num_key_value_heads=2, intermediate_size=64, vocab_size=128)
    ok = merge_dict(Config(), {"actor_rollout_ref": {"actor": {"tensor_model_parallel_size": 2}}})
    check_model_layouts(ok, 4, hf)
    bad_tp = merge_dict(Config(), {"actor_rollout_ref": {"actor": {"tensor_model_parallel_size": 4}}})
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.tensor_model_parallel_size=4 .*heads=6"):
        check_model_layouts(bad_tp, 4, hf)
    bad_sp = merge_dict(Config(), {"algorithm": {"adv_estimator": "gae"},
                                   "critic": {"tensor_model_parallel_size": 2, "ulysses_sequence_parallel_size": 2}})
    with pytest.raises(ConfigError, match=r"critic: ulysses_sequence_parallel_size=2 must divide the model's 3"):
        check_model_layouts(bad_sp, 4, hf)
