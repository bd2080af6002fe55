"""Checkpoint safety: a crafted DCP .metadata cannot run code on resume; a full disk is one line and loses
nothing (the free-space check before saving, and a real ENOSPC on a 1 MiB tmpfs when mounting is allowed).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import uuid

import pytest
import torch

from tinyzero.models.safe_dcp import SafeFileSystemReader, UnsafeCheckpointError
from tinyzero.trainer import checkpoint as ckpt_mod
from tinyzero.trainer.checkpoint import (
    CheckpointManager,
    CheckpointSpaceError,
    load_state,
    save_state,
    verify_checkpoint,
)


def _model(width: int = 8, fill: float | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width))
    if fill is not None:
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(fill)
    return m


class _WritesMarker:
    """Unpickling this calls os.system: what a crafted checkpoint would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_saved_checkpoint_loads_through_restricted_reader(tmp_path):
    src, dst = _model(fill=None), _model(fill=0.0)
    optim = torch.optim.AdamW(src.parameters(), lr=0.1)
    src(torch.randn(3, 8)).sum().backward()
    optim.step()  # optimizer state with step counters and param groups (byte entries in DCP)
    save_state(str(tmp_path / "actor"), src, optim)
    meta = SafeFileSystemReader(str(tmp_path / "actor")).read_metadata()
    assert any(k.startswith("optim.") for k in meta.state_dict_metadata)
    dst_optim = torch.optim.AdamW(dst.parameters(), lr=0.5)
    load_state(str(tmp_path / "actor"), dst, dst_optim)
    for a, b in zip(src.parameters(), dst.parameters()):
        assert torch.equal(a, b)
    assert dst_optim.param_groups[0]["lr"] == 0.1  # a byte entry, read with weights_only=True
    assert torch.equal(dst_optim.state[dst_optim.param_groups[0]["params"][0]]["exp_avg"],
                       optim.state[optim.param_groups[0]["params"][0]]["exp_avg"])


def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    model = _model()
    save_state(str(tmp_path / "actor"), model)
    marker = tmp_path / f"pwned-{uuid.uuid4().hex}"
    with open(tmp_path / "actor" / ".metadata", "wb") as f:
        pickle.dump(_WritesMarker(str(marker)), f)
    with pytest.raises(UnsafeCheckpointError) as err:
        load_state(str(tmp_path / "actor"), _model(), None)
    assert "actor/.metadata" in str(err.value) and "posix.system" in str(err.value)
    assert not marker.exists(), "the crafted checkpoint ran code"
    # Garbage (not a pickle at all) is one clear error naming the file too.
    (tmp_path / "actor" / ".metadata").write_bytes(b"\x00not a pickle")
    with pytest.raises(UnsafeCheckpointError, match="unreadable DCP metadata"):
        load_state(str(tmp_path / "actor"), _model(), None)


def _save(mgr: CheckpointManager, step: int, model) -> str:
    with mgr.saving(step) as tmp:
        save_state(os.path.join(tmp, "actor"), model)
    return os.path.join(mgr.root, f"global_step_{step}")


def test_low_disk_space_refuses_before_writing(tmp_path, monkeypatch):
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    first = _save(mgr, 1, _model(fill=1.0))
    last_bytes = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(first) for n in ns
                     if n != ckpt_mod.MARKER)  # the data files, as the manifest lists them
    free = ckpt_mod.SPACE_MARGIN_BYTES  # less than the last checkpoint's size + margin

    class Usage:
        total, used = 10 * free, 9 * free

    Usage.free = free
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(CheckpointSpaceError) as err:
        _save(mgr, 2, _model(fill=2.0))
    msg = str(err.value)
    needed = int(last_bytes * (1 + ckpt_mod.SPACE_MARGIN_FRACTION)) + ckpt_mod.SPACE_MARGIN_BYTES
    assert "\n" not in msg and mgr.root in msg and f"{needed} bytes needed, {free} free" in msg, msg
    assert f"previous checkpoint {first} is intact" in msg
    assert sorted(os.listdir(mgr.root)) == ["global_step_1", "latest_checkpointed_iteration.txt"]
    assert verify_checkpoint(first) is None and mgr.latest() == first


def test_real_enospc_on_a_tiny_tmpfs(tmp_path, monkeypatch):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        monkeypatch.setattr(ckpt_mod, "SPACE_MARGIN_BYTES", 0)  # let the save start, so the disk really fills
        mgr = CheckpointManager(str(mnt / "ckpt"))
        first = _save(mgr, 1, _model(fill=1.0))  # a few KiB
        with pytest.raises(CheckpointSpaceError) as err:
            _save(mgr, 2, _model(width=600, fill=2.0))  # ~1.4 MiB of float32 weights
        msg = str(err.value)
        assert "\n" not in msg and "step 2" in msg and "free" in msg and f"{first} is intact" in msg, msg
        assert sorted(os.listdir(mgr.root)) == ["global_step_1", "latest_checkpointed_iteration.txt"]
        assert verify_checkpoint(first) is None and mgr.latest() == first
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
