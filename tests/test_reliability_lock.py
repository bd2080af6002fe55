"""The run-folder lock: a second job is refused naming the holder (same process, another process, every rank
of a 2-rank job), a dead holder's record is taken over with a warning, another host's is refused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.dist_utils import run_distributed
from tinyzero.trainer.runlock import HOLDER_FILE, RunFolderBusy, RunLock, hold_run_folder

HOLDER_SCRIPT = """
import sys, time
from tinyzero.trainer.runlock import RunLock
lock = RunLock(sys.argv[1]); lock.acquire(); print("held", flush=True); time.sleep(60)
"""


def test_second_lock_is_refused_and_release_frees_it(tmp_path):
    first = RunLock(str(tmp_path / "run"))
    first.acquire()
    holder = json.loads((tmp_path / "run" / HOLDER_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(RunFolderBusy, match=f"in use by host {socket.gethostname()} pid {os.getpid()}"):
        RunLock(str(tmp_path / "run")).acquire()
    first.release()
    assert not (tmp_path / "run" / HOLDER_FILE).exists()
    second = RunLock(str(tmp_path / "run"))
    second.acquire()
    second.release()


def test_lock_held_by_another_process(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER_SCRIPT, str(tmp_path / "run")], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy, match=f"pid {proc.pid} "):
            RunLock(str(tmp_path / "run")).acquire()
    finally:
        proc.kill()
        proc.wait()
    # kill -9 left its record behind; the kernel dropped its lock: taken over with a warning.
    with pytest.warns(UserWarning, match=f"pid {proc.pid} .*is no longer running"):
        lock = RunLock(str(tmp_path / "run"))
        lock.acquire()
    assert json.loads((tmp_path / "run" / HOLDER_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_record_from_another_host_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / HOLDER_FILE).write_text(json.dumps({"host": "node-17", "pid": 4242, "start_time": time.time()}))
    with pytest.raises(RunFolderBusy, match=f"node-17 pid 4242.*delete {run / HOLDER_FILE}"):
        RunLock(str(run)).acquire()


def _both_ranks_try(run_dir: str) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        with hold_run_folder(run_dir):
            return "acquired"
    except RunFolderBusy as e:
        return str(e)


@pytest.mark.slow
def test_every_rank_learns_the_folder_is_busy(tmp_path):
    holder = RunLock(str(tmp_path / "run"))
    holder.acquire()
    try:
        results = run_distributed(_both_ranks_try, 2, str(tmp_path / "run"), timeout=120)
    finally:
        holder.release()
    assert all(f"pid {os.getpid()}" in r and "is in use by" in r for r in results), results
    assert run_distributed(_both_ranks_try, 2, str(tmp_path / "run"), timeout=120) == ["acquired", "acquired"]


def test_without_flock_a_live_holder_still_refuses(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    run = tmp_path / "run"
    run.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / HOLDER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": sleeper.pid,
                                                   "start_time": time.time()}))
        with pytest.warns(UserWarning, match="does not support locks"), \
                pytest.raises(RunFolderBusy, match=f"pid {sleeper.pid} "):
            RunLock(str(run)).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    with pytest.warns(UserWarning, match="is no longer running"):
        lock = RunLock(str(run))
        lock.acquire()
    lock.release()
