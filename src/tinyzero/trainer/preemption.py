"""Save on SIGTERM / SIGINT: Slurm and Kubernetes send SIGTERM some seconds before they kill a job.

    install_stop_handlers(grace_s=25.0)       # train.py, every rank (reliability.save_on_signal)
    ...
    signame = stop_requested()                # the trainer, at the end of every step (collective)
    if signame: save a checkpoint, then raise Preempted(...)

The handler only records the signal: the step in flight finishes, then every rank agrees (an
all-reduce of the flag, since the signal may reach the ranks at different moments, or only
one of them), saves, and exits non-zero saying so. If no safe point is reached within
`grace_s` of the signal, the process exits on its own with one line saying so (the last
checkpoint is intact, since saves are atomic). A second signal ends the process at once (a repeat
within 2 s is the same request), and so does a failure after the signal (no teardown). A signal
that torchrun sends because a rank on this host exited ends the process at once too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(RuntimeError):
    """The run stopped on a signal after saving; `exit_code` is 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class _State:
    installed = False
    signum: int | None = None
    received_at: float | None = None
    grace_s = 0.0
    previous: dict = {}
    timer: threading.Timer | None = None


# A repeat within this window is the same request: under Slurm (every process signalled) or Ctrl-C (the
# whole process group), torchrun forwards the signal it got itself a moment after the workers got theirs.
REPEAT_WINDOW_S = 2.0


def _local_peer_exited() -> bool:
    """Under torchrun, whether a worker on this host has exited: torchrun then signals the others to stop,
    and there is nothing to agree with (a failed job, not a preemption)."""
    expected = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if expected <= 1 or "TORCHELASTIC_RUN_ID" not in os.environ or not os.path.isdir("/proc"):
        return False
    parent, alive = os.getppid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            alive += int(ppid) == parent and state not in ("Z", "X")
    return alive < expected


def _on_signal(signum, frame) -> None:
    if _State.signum is None and _local_peer_exited():
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"[rank {rank}] received {signal.Signals(signum).name} after a rank on this host exited: stopping "
              "now", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    if _State.signum is not None:
        if time.monotonic() - _State.received_at < REPEAT_WINDOW_S:
            return
        signal.signal(signum, signal.SIG_DFL)  # a second signal: stop now, the default way
        os.kill(os.getpid(), signum)
        return
    _State.signum, _State.received_at = signum, time.monotonic()
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"[rank {rank}] received {signal.Signals(signum).name}: saving a checkpoint at the end of this step "
          f"(within {_State.grace_s:g} s; a second signal stops at once)", file=sys.stderr, flush=True)
    _State.timer = threading.Timer(_State.grace_s, _out_of_grace, args=(signum, rank))
    _State.timer.daemon = True
    _State.timer.start()


def _out_of_grace(signum: int, rank: int) -> None:
    print(f"[rank {rank}] stopped by {signal.Signals(signum).name}: no safe point within reliability.signal_grace_s="
          f"{_State.grace_s:g} s, so nothing was saved; the last checkpoint is intact (raise "
          f"reliability.signal_grace_s and the scheduler's kill delay to save on signals)", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def install_stop_handlers(grace_s: float) -> None:
    """Handle SIGTERM and SIGINT by requesting a save-and-stop (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _State.grace_s = float(grace_s)
    _State.signum = _State.received_at = None
    _State.previous = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    _State.installed = True


def uninstall_stop_handlers() -> None:
    """Restore the previous handlers and cancel a pending grace timer."""
    if not _State.installed:
        return
    for s, handler in _State.previous.items():
        signal.signal(s, handler)
    if _State.timer is not None:
        _State.timer.cancel()
    _State.installed, _State.timer, _State.signum = False, None, None


def stop_requested() -> str | None:
    """The signal's name if any rank received one, else None; the same answer on every rank.

    Collective over the world group when the handlers are installed (every rank installs them);
    a no-op returning None otherwise.
    """
    if not _State.installed:
        return None
    flag = torch.tensor([_State.signum or 0], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    signum = int(flag.item())
    return signal.Signals(signum).name if signum else None


def exit_if_signalled() -> None:
    """After a signal, a run that fails anyway exits at once (no teardown): whoever sent it wants it gone."""
    if _State.signum is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + _State.signum)


def finish(signame: str, step: int, saved_at: str) -> Preempted:
    """Cancel the grace timer and build the exception that ends the run after the save."""
    if _State.timer is not None:
        _State.timer.cancel()
    signum = int(getattr(signal, signame))
    return Preempted(f"stopped by {signame} after step {step}: checkpoint saved at {saved_at}; rerun the same "
                     "command to continue (resume_mode=auto)", signum)
