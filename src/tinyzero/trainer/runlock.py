"""One job per run folder: an exclusive lock on `trainer.default_local_dir` for the job's life.

Two jobs writing one run folder clobber each other (the second truncates metrics.jsonl and
removes the first's half-written checkpoint), so rank 0 takes the lock before anything in the
folder is written, and every rank learns the answer:

    with hold_run_folder(cfg.trainer.default_local_dir):    # every rank (collective)
        trainer.fit()

The lock is `fcntl.flock` on `<run>/run.lock` (never replaced or removed, so every job locks the
same inode); the kernel drops it when the holder exits, even on kill -9. Who holds it (host, pid,
start time) is in `<run>/run.lock.json`, written atomically (temp + rename). A record left by a
job that died is taken over with a warning; one from another host, while the lock itself is
free, is refused (some shared filesystems do not see locks across hosts), naming the file to
delete when that job is known to be gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import warnings

import torch.distributed as dist

LOCK_FILE = "run.lock"
HOLDER_FILE = "run.lock.json"


class RunFolderBusy(RuntimeError):
    """Another job holds the run folder; the message names it. Every rank raises the same one."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict) -> str:
    started = holder.get("start_time")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) \
        else "an unknown time"
    return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} (started {when})"


def _read_holder(path: str) -> dict | None:
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


class RunLock:
    """The lock of one run folder, held by this process (rank 0) between acquire() and release()."""

    def __init__(self, run_dir: str):
        self.run_dir = os.path.abspath(run_dir)
        self.lock_path = os.path.join(self.run_dir, LOCK_FILE)
        self.holder_path = os.path.join(self.run_dir, HOLDER_FILE)
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise RunFolderBusy naming the holder; a dead holder's record is taken over."""
        from tinyzero.trainer.checkpoint import _atomic_write_text

        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        flocked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _read_holder(self.holder_path)
            who = _describe(holder) if holder else "another job (its record is being written)"
            raise RunFolderBusy(f"run folder {self.run_dir} is in use by {who}; wait for that job to end, stop "
                                f"it, or pass another --trainer.default_local_dir") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            warnings.warn(f"the file system of {self.run_dir} does not support locks ({e.strerror}): only the "
                          f"holder record {self.holder_path} guards the folder", stacklevel=2)
            flocked = False
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": time.time()}
        holder = _read_holder(self.holder_path)
        if holder is not None:
            same_host = holder.get("host") == me["host"]
            pid = holder.get("pid")
            if not same_host:
                os.close(fd)
                raise RunFolderBusy(f"run folder {self.run_dir} was locked by {_describe(holder)}, which this host "
                                    f"cannot check; if that job is gone, delete {self.holder_path} and rerun")
            alive = isinstance(pid, int) and _pid_alive(pid)
            if alive and pid != me["pid"] and not flocked:
                os.close(fd)
                raise RunFolderBusy(f"run folder {self.run_dir} is in use by {_describe(holder)}; wait for that job "
                                    "to end, stop it, or pass another --trainer.default_local_dir")
            if pid != me["pid"]:
                state = "is no longer running" if not alive else "no longer holds the lock (its pid was reused)"
                warnings.warn(f"taking over the run folder lock of {_describe(holder)}, which {state}",
                              stacklevel=2)
        _atomic_write_text(self.holder_path, json.dumps(me))
        self.fd = fd

    def release(self) -> None:
        """Drop the record and the lock (the lock file stays, so later jobs lock the same inode)."""
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.holder_path)
        with contextlib.suppress(OSError):  # closing the fd drops the lock anyway
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


@contextlib.contextmanager
def hold_run_folder(run_dir: str):
    """Collective: rank 0 locks `run_dir` for the body; every rank raises RunFolderBusy if it cannot."""
    lock = RunLock(run_dir)
    error: list = [None]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        try:
            lock.acquire()
        except (RunFolderBusy, OSError) as e:
            error[0] = str(e) if isinstance(e, RunFolderBusy) else f"cannot lock run folder {run_dir}: {e}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise RunFolderBusy(error[0])
    try:
        yield lock
    finally:
        lock.release()
