"""One collective timeout for every group, failures that name the rank that failed first, and a
non-finite stop that states the checkpoint situation truthfully.

The timeout test runs 2 gloo ranks where rank 1 never joins: rank 0's collectives on the world
group and on a resource pool's group must both fail after the configured timeout (2 s), not the
old hard-coded 1800 s.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

from tests.dist_utils import run_distributed


def _never_joined(timeout_s: float) -> dict:
    import torch
    import torch.distributed as dist

    from tinyzero.distributed import collective_timeout_s, get_rank, init_distributed
    from tinyzero.single_controller import ResourcePool
    from tinyzero.single_controller.failure import _exit_message, abort_rank, record_abort

    init_distributed(timeout_s)  # as train.py passes reliability.collective_timeout_s
    pool = ResourcePool()  # its control group is a new gloo group
    out = {"resolved": collective_timeout_s()}
    if get_rank() == 1:
        record_abort("rank 1 failed on purpose")
        time.sleep(2 * timeout_s + 2)  # never joins: rank 0's collectives must time out
        out["own_exit_message"] = _exit_message("rank 1 failed on purpose")
        return out
    time.sleep(0.5)
    out["first_failed"] = abort_rank()
    out["peer_exit_message"] = _exit_message("rank 1 failed on purpose")
    for name, group in (("pool", pool.control_group), ("world", dist.group.WORLD)):
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            out[name] = None
        except Exception:  # noqa: BLE001 - what is measured is when it gives up
            out[name] = time.monotonic() - start
    return out


@pytest.mark.slow
def test_collective_timeout_applies_to_world_and_pool_groups_and_first_failure_is_named():
    got = run_distributed(_never_joined, 2, 2.0, timeout=120, env={"TINYZERO_ABORT_WATCHDOG": "0"})
    rank0, rank1 = got
    assert rank0["resolved"] == rank1["resolved"] == 2.0
    for name in ("pool", "world"):
        assert rank0[name] is not None, f"the {name} collective did not fail"
        assert 1.5 <= rank0[name] < 10, (name, rank0[name])  # 2 s, not 1800 s
    assert rank0["first_failed"] == 1
    assert "because rank 1 failed first" in rank0["peer_exit_message"]
    assert "rank 1: exiting after its own failure (the first of the job)" in rank1["own_exit_message"]
    assert "another rank failed" not in rank1["own_exit_message"]


def test_environment_overrides_the_configured_timeout(monkeypatch):
    from tinyzero.distributed import resolve_collective_timeout_s

    monkeypatch.delenv("TINYZERO_COLLECTIVE_TIMEOUT_S", raising=False)
    assert resolve_collective_timeout_s(None) == 1800.0
    assert resolve_collective_timeout_s(120.0) == 120.0
    monkeypatch.setenv("TINYZERO_COLLECTIVE_TIMEOUT_S", "45")
    assert resolve_collective_timeout_s(120.0) == 45.0
    monkeypatch.setenv("TINYZERO_COLLECTIVE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="TINYZERO_COLLECTIVE_TIMEOUT_S='soon' is not a number"):
        resolve_collective_timeout_s(120.0)


def test_timeouts_are_validated():
    from tinyzero.config import ConfigError, ReliabilityConfig

    assert ReliabilityConfig().hang_timeout_s == 300.0 and ReliabilityConfig().collective_timeout_s == 1800.0
    ReliabilityConfig(hang_timeout_s=0)  # 0 disables the watchdog
    with pytest.raises(ConfigError, match="reliability.hang_timeout_s must be >= 0"):
        ReliabilityConfig(hang_timeout_s=-1)
    with pytest.raises(ConfigError, match="reliability.collective_timeout_s must be > 0"):
        ReliabilityConfig(collective_timeout_s=0)


def _fake_trainer(root: str, nonfinite: str = "stop"):
    from tinyzero.trainer.checkpoint import CheckpointManager

    printed = []
    trainer = SimpleNamespace(config=SimpleNamespace(trainer=SimpleNamespace(save_freq=5),
                                                     reliability=SimpleNamespace(nonfinite=nonfinite)),
                              global_step=7, ckpt=CheckpointManager(root), tracker=SimpleNamespace(print=printed.append))
    return trainer, printed


def _check(trainer, metrics):
    from tinyzero.trainer.ppo import PPOTrainer

    trainer._checkpoint_situation = lambda: PPOTrainer._checkpoint_situation(trainer)
    PPOTrainer._check_finite(trainer, metrics, ("actor/pg_loss", "actor/grad_norm"), "actor/num_skipped_steps")


def test_nonfinite_stop_states_whether_a_checkpoint_exists(tmp_path):
    from tinyzero.trainer.ppo import NonFiniteError

    trainer, _ = _fake_trainer(str(tmp_path / "checkpoints"))
    with pytest.raises(NonFiniteError) as info:
        _check(trainer, {"actor/pg_loss": math.nan, "actor/grad_norm": 1.0})
    msg = str(info.value)
    assert "step 7: non-finite actor/pg_loss" in msg and "No checkpoint has been saved in" in msg, msg
    assert "trainer.save_freq=5" in msg and "intact" not in msg
    # A sealed checkpoint at step 5 (and an unsealed one at step 6, which does not count).
    tmp = trainer.ckpt.begin_save(5)
    (tmp_path / "checkpoints" / "global_step_6").mkdir()
    with open(f"{tmp}/state.txt", "w") as f:
        f.write("x")
    trainer.ckpt.finalize(5, tmp)
    with pytest.raises(NonFiniteError, match=r"The last checkpoint, step 5 in .*global_step_5, is intact"):
        _check(trainer, {"actor/pg_loss": 0.1, "actor/grad_norm": math.inf})
    skipping, printed = _fake_trainer(str(tmp_path / "checkpoints"), nonfinite="skip")
    _check(skipping, {"actor/pg_loss": math.nan})
    assert "skipping the batch" in printed[0]
