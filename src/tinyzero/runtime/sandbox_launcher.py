"""The sandbox's launcher: the first process of a sandboxed run (see tinyzero.runtime.sandbox).

    [unshare --net --mount --pid --fork --kill-child] python -I -S -B sandbox_launcher.py ARGS...

It is run as a script and imports only what it needs from the standard library (its start-up is
paid once per program run). Arguments, in order: the program file, "1" when it runs inside new
namespaces, the uid to switch to ("-" for none), the tmpfs size in MiB, the limits (cpu_time_s,
memory_mb, file_size_mb, max_open_files, max_processes joined by ","), the folders to hide and the
folders to keep (each joined by the unit separator \\x1f).

With namespaces it is PID 1 of the new PID namespace: it hides the host's folders under tmpfs
mounts, binds the kept folders (the interpreter) back read-only, mounts a fresh /proc, makes the
program's folder, then forks the program and reaps every orphan until the program is done. The
program runs in the forked child under the resource limits and the uid: the already-started
interpreter compiles and runs it as __main__ (no second interpreter start per run).
"""

import os
import resource
import sys

SANDBOX_DIR = "/tmp/sandbox"
"""Where the program's private folder appears inside its mount namespace."""

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
LAUNCHER_FAILED = 125
"""Exit code of a launcher that could not set the sandbox up (its stderr starts with [sandbox launcher])."""


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    def enc(s):
        return s.encode() if s is not None else None

    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or source} on {target}: {os.strerror(err)}")


def isolate_mounts(hide: list, keep: list, tmpfs_mb: int) -> None:
    """Hide the host's folders under tmpfs, bind the kept ones back read-only, mount a fresh /proc."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    kept = {p: os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in keep if os.path.isdir(p)}
    options = f"size={tmpfs_mb}m,nr_inodes=4096,mode=755"
    for path in hide:
        if os.path.isdir(path):
            _mount(libc, "tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    for path, fd in kept.items():
        if not os.path.isdir(path) or not os.listdir(path):  # it was under a hidden folder
            os.makedirs(path, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
            _mount(libc, None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        os.close(fd)
    _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)


def set_limits(cpu_time_s: float, memory_mb: int, file_size_mb: int, max_open_files: int, max_processes: int) -> None:
    cpu = max(1, int(-(-cpu_time_s // 1)))
    for which, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                              (resource.RLIMIT_AS, memory_mb << 20, memory_mb << 20),
                              (resource.RLIMIT_FSIZE, file_size_mb << 20, file_size_mb << 20),
                              (resource.RLIMIT_NOFILE, max_open_files, max_open_files),
                              (resource.RLIMIT_NPROC, max_processes, max_processes),
                              (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(which, (soft, hard))


def run_program(source: str, workdir: str, uid, limits: tuple) -> int:
    """In the program's own process: limits, uid, folder; then run `source` as __main__. Returns its exit code."""
    set_limits(*limits)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.chdir(workdir)
    os.closerange(3, 1 << 16)
    os.environ["HOME"] = workdir
    sys.argv = ["program.py"]
    sys.path[:] = [workdir, *(p for p in sys.path if p and p != os.path.dirname(os.path.abspath(__file__)))]
    namespace = {"__name__": "__main__", "__file__": os.path.join(workdir, "program.py"), "__builtins__": __builtins__}
    try:
        exec(compile(source, namespace["__file__"], "exec"), namespace)  # noqa: S102 - inside the sandbox
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        print(code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - the program's own failure, printed like Python does
        try:
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001 - e.g. no memory left to import traceback
            sys.stderr.write(f"{type(e).__name__}: {e}\n")
        return 1
    return 0


def launch(argv: list) -> int:
    program, namespaced, uid, tmpfs_mb, limits, hide, keep = argv
    uid = None if uid == "-" else int(uid)
    cpu, mem, fsize, nofile, nproc = limits.split(",")
    limits = (float(cpu), int(mem), int(fsize), int(nofile), int(nproc))
    with open(program, encoding="utf-8") as f:
        source = f.read()
    if namespaced != "1":
        workdir = os.path.dirname(program)
        if uid is not None:
            os.chown(workdir, uid, uid)
        return run_program(source, workdir, uid, limits)
    isolate_mounts([p for p in hide.split("\x1f") if p], [p for p in keep.split("\x1f") if p], int(tmpfs_mb))
    os.makedirs(SANDBOX_DIR, mode=0o700)
    with open(os.path.join(SANDBOX_DIR, "program.py"), "w", encoding="utf-8") as f:
        f.write(source)
    if uid is not None:
        os.chown(SANDBOX_DIR, uid, uid)
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        code = LAUNCHER_FAILED
        try:
            code = run_program(source, SANDBOX_DIR, uid, limits)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    while True:  # PID 1 of the namespace: reap orphans until the program is done
        pid, status = os.wait()
        if pid == child:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    try:
        exit_code = launch(sys.argv[1:])
    except BaseException as e:  # noqa: BLE001 - the sandbox's own failure, named for the parent
        print(f"[sandbox launcher] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        exit_code = LAUNCHER_FAILED
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(exit_code)
