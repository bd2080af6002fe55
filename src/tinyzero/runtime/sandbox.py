"""Run untrusted programs (model-written Python) in a separate, limited, isolated process.

    from tinyzero.runtime.sandbox import Sandbox, SandboxLimits
    box = Sandbox()                                   # probes once what isolation the OS allows
    r = box.run("print(int(input()) * 2)", stdin="21\\n", limits=SandboxLimits(cpu_time_s=1))
    r.status, r.stdout                                # ("ok", "42\\n")
    results = box.run_many([(code, stdin, limits), ...])   # at most max_concurrent at a time

Every program runs in its own process tree, started by a small launcher (sandbox_launcher.py run
as a script under `python -I -S`, importing little but the standard library's core):
  - with namespaces (`unshare` works: root, or unprivileged user namespaces): new network (no
    interfaces but a down loopback), mount and PID namespaces. Fresh tmpfs mounts hide /tmp,
    /var/tmp, /dev/shm, /root, /home, the trainer's working folder and $HOME (plus any hide_paths);
    the interpreter's own folder is bound back read-only. The program runs in a private folder on
    a size-limited tmpfs, with a fresh /proc showing only its own processes; when it ends or is
    killed, everything in its PID namespace dies and its files vanish. When the trainer runs as
    root the program also runs under its own unprivileged uid (uid_base + a per-process slot), so
    it can neither signal nor read what the trainer's user owns, and the process-count limit holds.
  - without namespaces ("process" isolation): a new session in a private temporary folder,
    under the same resource limits (and a separate uid when root); said once, naming what failed.
Always: a minimal environment (no variable of the trainer's environment reaches it), CPU-time,
address-space, file-size, open-file and process-count limits (setrlimit in the launcher before
exec), a wall-time limit after which its whole process group is SIGKILLed, and stdout / stderr
read in chunks up to max_output_bytes each (a program that writes more is killed: "output_limit").

What this does not protect against (docs/code_rewards.md says it for users): it is not a VM. The
program shares the kernel with the trainer; a kernel exploit escapes it. Root in a container is
only as strong as the container. Use a dedicated sandbox service (SandboxFusion; the code scorer's
`sandbox.url`) for programs from adversaries or for other languages.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from tinyzero.runtime import sandbox_launcher

__all__ = ["Sandbox", "SandboxLimits", "RunResult", "probe_isolation", "get_sandbox"]

Isolation = Literal["auto", "namespaces", "process"]
Status = Literal["ok", "error", "timeout", "output_limit", "sandbox_error"]

_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
"""The whole environment of a sandboxed program (HOME is set to its own folder)."""

_READ_CHUNK = 65536


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one program run."""

    cpu_time_s: float = 5.0
    """CPU seconds (RLIMIT_CPU, rounded up to whole seconds; SIGKILL one second later)."""
    wall_time_s: float = 10.0
    """Wall-clock seconds from launch; past it the whole process group is killed ("timeout")."""
    memory_mb: int = 1024
    """Address space in MiB (RLIMIT_AS): an allocation past it fails (MemoryError in Python)."""
    file_size_mb: int = 16
    """Largest file the program may write, in MiB (RLIMIT_FSIZE); also the size of its tmpfs folder."""
    max_open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_processes: int = 16
    """Processes and threads of the program's uid (RLIMIT_NPROC); holds where the program has its own
    uid (the trainer runs as root) or its own user namespace."""
    max_output_bytes: int = 1 << 20
    """Bytes kept from each of stdout and stderr; a program writing more is killed ("output_limit")."""

    def __post_init__(self):
        for name in ("cpu_time_s", "wall_time_s", "memory_mb", "file_size_mb", "max_open_files", "max_processes",
                     "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")


@dataclass
class RunResult:
    """What one program run did."""

    status: Status
    """"ok" (exit code 0), "error" (non-zero exit or a signal: an exception, a resource limit), "timeout"
    (wall time), "output_limit" (too much output), "sandbox_error" (the sandbox itself failed)."""
    returncode: int | None
    """The program's exit code; 128 + N when signal N ended it; None when it was killed from outside."""
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = False
    """stdout or stderr was cut at max_output_bytes."""


# --------------------------------------------------------------------------- the parent side

_PROBED: dict[str, tuple[bool, str]] = {}
_PROBE_LOCK = threading.Lock()


def _unshare_cmd() -> list[str] | None:
    exe = shutil.which("unshare")
    if exe is None:
        return None
    cmd = [exe, "--net", "--mount", "--pid", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        cmd[1:1] = ["--user", "--map-root-user"]
    return cmd


def probe_isolation() -> tuple[bool, str]:
    """(namespaces usable, what is missing); probed once per process by launching a no-op."""
    with _PROBE_LOCK:
        if "result" not in _PROBED:
            cmd = _unshare_cmd()
            if cmd is None:
                _PROBED["result"] = (False, "the `unshare` program (util-linux) is not installed")
            else:
                try:
                    p = subprocess.run([*cmd, sys.executable, "-I", "-S", "-c", "pass"], capture_output=True,
                                       env=_ENV, timeout=30)
                    ok = p.returncode == 0
                    why = "" if ok else f"`{' '.join(cmd)}` failed: {p.stderr.decode(errors='replace').strip()[:300]}"
                except (OSError, subprocess.TimeoutExpired) as e:
                    ok, why = False, f"`unshare` could not run: {e}"
                _PROBED["result"] = (ok, why)
        return _PROBED["result"]


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is `uid` (process isolation as root: catches escapees of the
    process group); repeated while any remain, since a fork bomb forks while we scan."""
    for _ in range(200):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    line = next((ln for ln in f if ln.startswith("Uid:")), "")
                if line and int(line.split()[1]) == uid:
                    os.kill(int(entry), signal.SIGKILL)
                    found = True
            except (OSError, ValueError, StopIteration):
                continue
        if not found:
            return
        time.sleep(0.01)


def _others_can_read(path: str) -> bool:
    """Whether a user other than the owner can reach `path` (every folder on the way has o+x)."""
    path = os.path.realpath(path)
    while True:
        try:
            if not os.stat(path).st_mode & 0o001:
                return False
        except OSError:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


class Sandbox:
    """Runs programs isolated and limited (see the module docstring); thread-safe, bounded concurrency."""

    def __init__(self, isolation: Isolation = "auto", max_concurrent: int = 4, uid_base: int = 61000,
                 hide_paths: tuple[str, ...] | list[str] = ()):
        if isolation not in ("auto", "namespaces", "process"):
            raise ValueError(f"sandbox isolation must be auto, namespaces or process, got {isolation!r}")
        if not 1 <= max_concurrent <= 256:
            raise ValueError(f"sandbox max_concurrent must be in 1..256, got {max_concurrent}")
        self.max_concurrent = max_concurrent
        self.namespaces = False
        if isolation != "process":
            ok, missing = probe_isolation()
            if not ok and isolation == "namespaces":
                raise RuntimeError(f"sandbox isolation=namespaces is not available here: {missing}. Allow "
                                   "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), "
                                   "run where they are, or set isolation=process")
            if not ok:
                _warn_once(f"[sandbox] warning: no namespace isolation ({missing}); programs run as separate "
                           "limited processes in private folders, but can see the network and the file system "
                           "(set sandbox.isolation=process to silence this)")
            self.namespaces = ok
        root = os.geteuid() == 0
        if root and not self.namespaces and not _others_can_read(sys.base_prefix):
            _warn_once(f"[sandbox] warning: the interpreter under {sys.base_prefix} is not readable by other users, "
                       "so programs run as root (process isolation); use namespaces or a world-readable Python")
            root = False
        # A uid of its own per concurrent run, distinct across the trainer processes on this host.
        self._uids = ([uid_base + (os.getpid() % 1_000_000) * 256 + i for i in range(max_concurrent)]
                      if root else [None] * max_concurrent)
        self._slots: list = list(range(max_concurrent))
        self._slot_cv = threading.Condition()
        home = os.path.expanduser("~")
        hide = ["/tmp", "/var/tmp", "/dev/shm", "/root", "/home", os.getcwd(), home, *hide_paths,
                tempfile.gettempdir()]
        self._hide = sorted({os.path.realpath(p) for p in hide if os.path.realpath(p) != "/"})
        self._python = os.path.realpath(sys.executable)
        self._keep = sorted({os.path.realpath(sys.base_prefix), os.path.dirname(self._python)})
        self._pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="sandbox")

    # ------------------------------------------------------------------ one run
    def run(self, code: str, stdin: str = "", limits: SandboxLimits | None = None,
            cancel: threading.Event | None = None) -> RunResult:
        """Run `code` as a Python program with `stdin`; blocks until it ends, is killed, or `cancel` is set."""
        limits = limits or SandboxLimits()
        with self._slot_cv:
            while not self._slots:
                self._slot_cv.wait()
            slot = self._slots.pop()
        try:
            return self._run_in_slot(code, stdin, limits, slot, cancel)
        finally:
            with self._slot_cv:
                self._slots.append(slot)
                self._slot_cv.notify()

    def _run_in_slot(self, code: str, stdin: str, limits: SandboxLimits, slot: int,
                     cancel: threading.Event | None) -> RunResult:
        uid = self._uids[slot]
        host_dir = tempfile.mkdtemp(prefix="tinyzero-sandbox-")
        start = time.monotonic()
        try:
            program = os.path.join(host_dir, "program.py")
            with open(program, "w", encoding="utf-8") as f:
                f.write(code)
            stdin_path = os.path.join(host_dir, "stdin")
            with open(stdin_path, "w", encoding="utf-8") as f:
                f.write(stdin)
            numbers = (limits.cpu_time_s, limits.memory_mb, limits.file_size_mb, limits.max_open_files,
                       limits.max_processes)
            launcher = [self._python, "-I", "-S", "-B", sandbox_launcher.__file__, program,
                        "1" if self.namespaces else "0", "-" if uid is None else str(uid), str(limits.file_size_mb),
                        ",".join(str(x) for x in numbers), "\x1f".join(self._hide), "\x1f".join(self._keep)]
            cmd = [*_unshare_cmd(), *launcher] if self.namespaces else launcher
            with open(stdin_path, "rb") as stdin_file:
                try:
                    proc = subprocess.Popen(cmd, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            env=dict(_ENV), cwd=host_dir, start_new_session=True, close_fds=True)
                except OSError as e:
                    return RunResult("sandbox_error", None, "", f"could not start the sandbox: {e}", 0.0)
            return self._collect(proc, limits, start, uid, cancel)
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)

    def _collect(self, proc: subprocess.Popen, limits: SandboxLimits, start: float, uid: int | None,
                 cancel: threading.Event | None) -> RunResult:
        """Read both pipes (bounded) until EOF, the wall limit, the output limit or `cancel`; then reap."""
        bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        sel = selectors.DefaultSelector()
        for stream in bufs:
            sel.register(stream, selectors.EVENT_READ)
        killed: Status | None = None
        truncated = False
        deadline = start + limits.wall_time_s
        try:
            while sel.get_map() and killed is None:
                now = time.monotonic()
                if now >= deadline:
                    killed = "timeout"
                    break
                if cancel is not None and cancel.is_set():
                    killed = "sandbox_error"
                    break
                for key, _ in sel.select(timeout=min(0.05, deadline - now)):
                    data = os.read(key.fd, _READ_CHUNK)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    buf = bufs[key.fileobj]
                    room = limits.max_output_bytes - len(buf)
                    buf += data[:max(room, 0)]
                    if len(data) > room:
                        truncated, killed = True, "output_limit"
                        break
            if killed is None:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    killed = "timeout"
        finally:
            sel.close()
            if killed is not None or proc.poll() is None:
                self._kill(proc, uid)
            proc.wait()
            for stream in bufs:
                stream.close()
            if uid is not None and (killed is not None or not self.namespaces):
                # Process isolation: anything that left the process group. Namespaces: after a kill the
                # namespace's processes die asynchronously; the slot's uid is reused only once they are gone
                # (a namespace whose program exited is empty before its launcher can be reaped).
                _kill_uid(uid)
        wall = time.monotonic() - start
        out = bufs[proc.stdout].decode("utf-8", errors="replace")
        err = bufs[proc.stderr].decode("utf-8", errors="replace")
        if killed == "sandbox_error":
            return RunResult("sandbox_error", None, out, err + "\n[cancelled]", wall, truncated)
        if killed is not None:
            return RunResult(killed, None, out, err, wall, truncated)
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        if code == sandbox_launcher.LAUNCHER_FAILED and err.startswith("[sandbox launcher]"):
            return RunResult("sandbox_error", code, out, err, wall, truncated)
        return RunResult("ok" if code == 0 else "error", code, out, err, wall, truncated)

    @staticmethod
    def _kill(proc: subprocess.Popen, uid: int | None) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher leads the group (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    # ------------------------------------------------------------------ many runs
    def run_many(self, jobs: list[tuple[str, str, SandboxLimits]], stop_on_failure: bool = False) -> list[RunResult]:
        """Run (code, stdin, limits) jobs, max_concurrent at a time, results in order. If this thread is
        interrupted (an exception, a reward alarm) every run in flight is killed before it propagates.
        stop_on_failure: once one run is not "ok", runs not yet started return status "sandbox_error"
        with stderr "[skipped]" (all-or-nothing scoring needs no more)."""
        cancel = threading.Event()
        skip = threading.Event()

        def one(job):
            if skip.is_set() or cancel.is_set():
                return RunResult("sandbox_error", None, "", "[skipped]", 0.0)
            r = self.run(*job, cancel=cancel)
            if stop_on_failure and r.status != "ok":
                skip.set()
            return r

        futures = [self._pool.submit(one, job) for job in jobs]
        try:
            return [f.result() for f in futures]
        except BaseException:
            cancel.set()
            for f in futures:
                f.cancel()
            for f in futures:
                if not f.cancelled():
                    try:
                        f.result(timeout=5)
                    except BaseException:  # noqa: BLE001 - the original exception propagates
                        pass
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr, flush=True)


_SANDBOXES: dict[tuple, Sandbox] = {}
_SANDBOXES_LOCK = threading.Lock()


def get_sandbox(isolation: Isolation = "auto", max_concurrent: int = 4, uid_base: int = 61000,
                hide_paths: tuple[str, ...] = ()) -> Sandbox:
    """The process's shared Sandbox for these settings (one probe, one thread pool, one set of uids)."""
    key = (isolation, max_concurrent, uid_base, tuple(hide_paths))
    with _SANDBOXES_LOCK:
        if key not in _SANDBOXES:
            _SANDBOXES[key] = Sandbox(isolation, max_concurrent, uid_base, hide_paths)
        return _SANDBOXES[key]
