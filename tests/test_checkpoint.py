"""Checkpoints: atomic step folders, corruption detection, keep-last-K, kill -9 mid-save, DCP save/load on
the same and a different number of ranks, RNG and trainer state.

`python -m tests.test_checkpoint ROOT` is the child process the kill -9 test runs: it saves checkpoints of a
model whose every weight equals the step number, forever.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed
from tinyzero.trainer.checkpoint import (
    _TMP_RE,
    CheckpointManager,
    load_rng_state,
    load_state,
    load_trainer_state,
    save_rng_state,
    save_state,
    save_trainer_state,
    verify_checkpoint,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _toy_model(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))


def _save_step(mgr: CheckpointManager, step: int, model, optim=None, critic=None) -> str:
    tmp = mgr.begin_save(step)
    save_state(os.path.join(tmp, "actor"), model, optim)
    if critic is not None:  # a second role writes its own sub-folder of the same step
        save_state(os.path.join(tmp, "critic"), critic)
    save_trainer_state(tmp, {"global_step": step, "dataloader": {"epoch": 0, "index": step * 4}})
    save_rng_state(tmp)
    return mgr.finalize(step, tmp)


def test_keep_last_latest_and_corruption(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ckpt"), keep_last=2)
    model, critic = _toy_model(), _toy_model(8)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
            for p in critic.parameters():
                p.fill_(-step)
        _save_step(mgr, step, model, critic=critic)
    assert [s for s, _ in mgr.checkpoints()] == [3, 2]  # step 1 pruned
    manifest = json.load(open(os.path.join(mgr.root, "global_step_3", "COMPLETE.json")))
    assert {"actor/.metadata", "critic/.metadata", "trainer_state.json", "rng/rank_0.json"} <= set(manifest["files"])
    assert all(len(info["sha256"]) == 64 for info in manifest["files"].values())
    fresh_critic = _toy_model(8)
    load_state(os.path.join(mgr.root, "global_step_3", "critic"), fresh_critic)
    assert all(torch.all(p == -3) for p in fresh_critic.parameters())
    assert mgr.latest().endswith("global_step_3")
    assert open(os.path.join(mgr.root, "latest_checkpointed_iteration.txt")).read() == "3"
    assert load_trainer_state(mgr.latest())["dataloader"]["index"] == 12

    # A half-written folder (no marker) with a higher step is skipped, with a warning naming it.
    half = os.path.join(mgr.root, "global_step_4")
    os.makedirs(os.path.join(half, "actor"))
    open(os.path.join(half, "actor", "__0_0.distcp"), "wb").write(b"partial")
    with pytest.warns(UserWarning, match="global_step_4.*no COMPLETE.json"):
        assert mgr.latest().endswith("global_step_3")

    # Flip bytes in a shard of step 3 (same size): the checksum catches it and step 2 is used.
    shard = next(f for f in os.listdir(os.path.join(mgr.root, "global_step_3", "actor")) if f.endswith(".distcp"))
    path3 = os.path.join(mgr.root, "global_step_3", "actor", shard)
    data = bytearray(open(path3, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path3, "wb").write(bytes(data))
    with pytest.warns(UserWarning) as record:
        latest = mgr.latest()
    assert latest.endswith("global_step_2")
    messages = " ".join(str(w.message) for w in record)
    assert "global_step_4" in messages and "global_step_3" in messages and "checksum mismatch" in messages

    # A truncated file is caught by the size check alone.
    open(path3, "wb").write(bytes(data[:10]))
    assert "size of" in verify_checkpoint(os.path.join(mgr.root, "global_step_3"), checksum=False)

    # Explicit resume paths are validated; auto / disable resolve.
    with pytest.raises(ValueError, match="cannot resume"):
        mgr.resolve_resume(os.path.join(mgr.root, "global_step_3"))
    assert mgr.resolve_resume("disable") is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mgr.resolve_resume("auto").endswith("global_step_2")
    fresh = _toy_model()
    load_state(os.path.join(mgr.resolve_resume(os.path.join(mgr.root, "global_step_2")), "actor"), fresh)
    assert all(torch.all(p == 2) for p in fresh.parameters())
    with pytest.raises(ValueError, match="without optimizer state"):
        load_state(os.path.join(mgr.root, "global_step_2", "actor"), fresh, torch.optim.AdamW(fresh.parameters()))
    with pytest.raises(ValueError, match="no DCP checkpoint"):
        load_state(str(tmp_path), fresh)


def test_rng_state_round_trip_and_missing_rank(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    tmp = mgr.begin_save(7)
    save_rng_state(tmp)
    expected = (torch.rand(4), np.random.rand(4), __import__("random").random())
    final = mgr.finalize(7, tmp)
    torch.rand(10), np.random.rand(3)  # move the streams on
    assert load_rng_state(final)
    got = (torch.rand(4), np.random.rand(4), __import__("random").random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]
    os.remove(os.path.join(final, "rng", "rank_0.json"))
    with pytest.warns(UserWarning, match="no RNG state for rank 0"):
        assert not load_rng_state(final, seed=3)
    a = torch.rand(3)
    with pytest.warns(UserWarning):
        load_rng_state(final, seed=3)
    assert torch.equal(torch.rand(3), a)  # the derived seed is deterministic


# ---------------------------------------------------------------------------- kill -9 mid-save


def _child_main(root: str) -> None:
    mgr = CheckpointManager(root, keep_last=2)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # ~8 MiB per save
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        _save_step(mgr, step, model)


def test_kill_during_save_keeps_previous_loadable(tmp_path):
    root = str(tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.test_checkpoint", root], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    killed_mid_save = False
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            names = os.listdir(root) if os.path.isdir(root) else []
            done = [n for n in names if n.startswith("global_step_") and ".tmp-" not in n]
            tmps = [n for n in names if _TMP_RE.match(n) and not n.startswith("global_step_1.")]
            if done and tmps:
                os.kill(proc.pid, signal.SIGKILL)
                killed_mid_save = True
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert killed_mid_save, f"child never reached a second save: {proc.stderr.read().decode()[-2000:]}"
    mgr = CheckpointManager(root, keep_last=2)
    assert any(_TMP_RE.match(n) for n in os.listdir(root))  # the interrupted save is still there ...
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        latest = mgr.latest()  # ... and never chosen
    assert latest is not None and ".tmp-" not in latest
    step = load_trainer_state(latest)["global_step"]
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    load_state(os.path.join(latest, "actor"), model)
    assert all(torch.all(p == step) for p in model.parameters())
    with pytest.warns(UserWarning, match="removing unfinished checkpoint"):
        tmp = mgr.begin_save(step + 1)
    assert [n for n in os.listdir(root) if _TMP_RE.match(n)] == [os.path.basename(tmp)]
    mgr.abort(tmp)


# ---------------------------------------------------------------------------- DCP on FSDP2, resharding


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (4, 9), generator=g)


def _train_step(model, optim, sched, seed, world, rank):
    ids = _batch(seed)
    per = ids.shape[0] // world
    ids = ids[rank * per:(rank + 1) * per]
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    sched.step()
    optim.zero_grad(set_to_none=True)
    return loss.detach()


def _full_state(model, optim):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return _flatten(msd), _flatten(osd)


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _flatten(v, f"{prefix}/{k}").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in _flatten(v, f"{prefix}/{i}").items()}
    if isinstance(obj, torch.Tensor):
        full = obj.full_tensor() if hasattr(obj, "full_tensor") else obj
        return {prefix: full.detach().cpu().numpy().copy()}
    return {prefix: obj}


def _build(path):
    import torch.distributed as dist

    from tinyzero.distributed import init_distributed
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.fsdp import load_sharded_model, make_fsdp_mesh

    init_distributed()
    fsdp_cfg = FSDPConfig()
    model = load_sharded_model(ModelConfig(path=path, enable_gradient_checkpointing=False), fsdp_cfg,
                               make_fsdp_mesh(fsdp_cfg, "cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    return model, optim, sched, dist.get_rank(), dist.get_world_size()


def _save_run(path, root):
    """Two steps, save at step 2, then a third step; return states at the save and after step 3, and what a
    fresh model / optimizer / scheduler resumed from the checkpoint in the same processes does."""
    model, optim, sched, rank, world = _build(path)
    torch.manual_seed(100 + rank)
    for s in (1, 2):
        _train_step(model, optim, sched, s, world, rank)
    mgr = CheckpointManager(root, keep_last=1)
    tmp = mgr.begin_save(2)
    save_state(os.path.join(tmp, "actor"), model, optim, sched, extra={"kl_coef": 0.01})
    save_rng_state(tmp)
    save_trainer_state(tmp, {"global_step": 2})
    mgr.finalize(2, tmp)
    at_save = _full_state(model, optim)
    draw = torch.rand(3).numpy()
    _train_step(model, optim, sched, 3, world, rank)
    return (at_save, _full_state(model, optim), draw, sched.get_last_lr()), _resume_run(path, root)


def _resume_run(path, root):
    model, optim, sched, rank, world = _build(path)
    mgr = CheckpointManager(root)
    ckpt = mgr.resolve_resume("auto")
    extra = load_state(os.path.join(ckpt, "actor"), model, optim, sched)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        load_rng_state(ckpt)
    loaded = _full_state(model, optim)
    draw = torch.rand(3).numpy()
    _train_step(model, optim, sched, 3, world, rank)
    return loaded, _full_state(model, optim), draw, sched.get_last_lr(), extra, [str(w.message) for w in record]


def _assert_states_equal(a, b, atol=0.0):
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], np.ndarray):
                np.testing.assert_allclose(x[k], y[k], atol=atol, rtol=0, err_msg=k)
            else:
                assert x[k] == y[k], k


@pytest.mark.slow
def test_dcp_resume_same_and_different_world_size(tiny_model_dir, tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_distributed(_save_run, 2, tiny_model_dir, root)
    saved = [r[0] for r in results]
    at_save, after, draws, lr = saved[0]

    # Same world size: exact restore, and the next step reproduces the uninterrupted run bit for bit.
    resumed = [r[1] for r in results]
    for rank, (loaded, after2, draw2, lr2, extra, rng_warnings) in enumerate(resumed):
        assert rng_warnings == []
        _assert_states_equal(loaded, at_save)
        _assert_states_equal(after2, after)
        np.testing.assert_array_equal(draw2, saved[rank][2])
        assert lr2 == lr and extra == {"kl_coef": 0.01}

    # One rank: DCP reshards model and optimizer; rank 0's RNG stream is restored.
    (loaded, after1, draw1, lr1, _, rng_warnings), = run_distributed(_resume_run, 1, tiny_model_dir, root)
    assert any("saved by 2 ranks and is resumed on 1" in w for w in rng_warnings), rng_warnings
    _assert_states_equal(loaded, at_save)
    np.testing.assert_array_equal(draw1, draws)
    # The next step sees the whole batch on one rank: same math up to fp32 summation order.
    _assert_states_equal(after1, after, atol=1e-5)
    assert lr1 == lr


if __name__ == "__main__":
    _child_main(sys.argv[1])


def test_resave_same_step_and_interrupted_resave(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    model = _toy_model()
    _save_step(mgr, 1, model)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(5.0)
    _save_step(mgr, 1, model)  # re-saving a step replaces it atomically
    assert sorted(os.listdir(mgr.root)) == ["global_step_1", "latest_checkpointed_iteration.txt"]
    fresh = _toy_model()
    load_state(os.path.join(mgr.latest(), "actor"), fresh)
    assert all(torch.all(p == 5.0) for p in fresh.parameters())
    # A crash after the old copy was moved aside but before the new one landed: the old one comes back.
    os.replace(os.path.join(mgr.root, "global_step_1"), os.path.join(mgr.root, "global_step_1.old-x1"))
    assert mgr.latest() is None
    with pytest.warns(UserWarning, match="restoring .*global_step_1.old-x1"):
        tmp = mgr.begin_save(2)
    mgr.abort(tmp)
    assert mgr.latest().endswith("global_step_1")
