"""The code sandbox: right output, limits, and adversarial programs that must fail without touching the host.

Each adversarial program prints what it could only print if its attack worked; the code scorer must
score it 0, the test process must live on, and no file may appear outside the sandbox's folder.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import pytest

from tinyzero.rewards.code_exec import compute_score
from tinyzero.rewards.sandbox_config import SandboxConfig
from tinyzero.runtime.sandbox import Sandbox, SandboxLimits, probe_isolation

NAMESPACES, MISSING = probe_isolation()
needs_ns = pytest.mark.skipif(not NAMESPACES, reason=f"no namespace isolation here: {MISSING}")
LIMITS = SandboxLimits(cpu_time_s=1, wall_time_s=2, memory_mb=256, max_output_bytes=1 << 16, max_processes=16)
CFG = SandboxConfig(timeout_s=1, wall_timeout_s=2, memory_limit_mb=256, max_output_bytes=1 << 16)
HUGE_OUTPUT = "import sys\nprint('42')\nwhile True:\n    sys.stdout.write('x' * 65536)"
MODES = ["process", pytest.param("namespaces", marks=needs_ns)]


def gt(expected: str) -> dict:
    return {"inputs": [""], "outputs": [expected]}


@pytest.mark.parametrize("isolation", MODES)
def test_runs_a_program_with_stdin(isolation):
    box = Sandbox(isolation=isolation)
    r = box.run("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", "1 2 39\n", LIMITS)
    assert (r.status, r.returncode, r.stdout) == ("ok", 0, "42\n")
    r = box.run("raise SystemExit(3)", "", LIMITS)
    assert (r.status, r.returncode) == ("error", 3)


@pytest.mark.parametrize("isolation", MODES)
def test_environment_is_minimal(isolation, monkeypatch):
    monkeypatch.setenv("TINYZERO_TEST_SECRET", "s3cret-value")
    code = "import os\nprint(os.environ.get('TINYZERO_TEST_SECRET', 'none'))"
    assert Sandbox(isolation=isolation).run(code, "", LIMITS).stdout == "none\n"
    assert compute_score(code, gt("s3cret-value"), SandboxConfig(**{**CFG.__dict__, "isolation": isolation}))[
        "score"] == 0.0


@pytest.mark.parametrize("isolation", MODES)
def test_infinite_loop_memory_hog_and_huge_output_fail_within_limits(isolation):
    box = Sandbox(isolation=isolation)
    start = time.monotonic()
    r = box.run("while True:\n    pass\nprint('42')", "", LIMITS)
    assert r.status in ("timeout", "error") and r.stdout == ""
    r = box.run("x = bytearray(2 * 10**9)\nprint('42')", "", LIMITS)
    assert r.status == "error" and "MemoryError" in r.stderr
    r = box.run(HUGE_OUTPUT, "", LIMITS)
    assert r.status == "output_limit" and r.truncated and len(r.stdout.encode()) <= LIMITS.max_output_bytes
    assert time.monotonic() - start < 3 * LIMITS.wall_time_s + 3
    cfg = SandboxConfig(**{**CFG.__dict__, "isolation": isolation})
    for code in ("while True:\n    pass\nprint('42')", "x = bytearray(2 * 10**9)\nprint('42')",
                 HUGE_OUTPUT):
        assert compute_score(code, gt("42"), cfg)["score"] == 0.0, code


def _uids_alive(low: int, high: int) -> list[int]:
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    uid = int(next(ln for ln in f if ln.startswith("Uid:")).split()[1])
            except (OSError, StopIteration, ValueError):
                continue
            if low <= uid < high:
                alive.append(int(entry))
    return alive


@pytest.mark.slow
@needs_ns
def test_fork_bomb_is_contained_and_reaped():
    box = Sandbox(isolation="namespaces", max_concurrent=1)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    r = box.run(bomb, "", LIMITS)
    assert r.status in ("timeout", "error")
    assert time.monotonic() - start < LIMITS.wall_time_s + 3
    if os.geteuid() == 0:  # every process of the run's uid is gone
        uid = box._uids[0]
        assert _uids_alive(uid, uid + 1) == []
    assert compute_score(bomb + "\nprint('42')", gt("42"), CFG)["score"] == 0.0


@needs_ns
def test_no_view_of_the_run_folder_home_or_tmp(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "secret.txt").write_text("run-folder-secret")
    monkeypatch.chdir(run_dir)  # the trainer's working folder, hidden from programs
    box = Sandbox(isolation="namespaces")
    for path in (str(run_dir / "secret.txt"), "/proc/1/environ"):
        code = f"print(open({path!r}).read())"
        r = box.run(code, "", LIMITS)
        assert r.status == "error" and "run-folder-secret" not in r.stdout, r
    assert compute_score(f"print(open({str(run_dir / 'secret.txt')!r}).read())", gt("run-folder-secret"),
                         CFG)["score"] == 0.0
    r = box.run("import os\nprint(sorted(os.listdir('/tmp')), os.getcwd())", "", LIMITS)
    assert r.stdout == "['sandbox'] /tmp/sandbox\n"


@needs_ns
def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def answer():
        server.settimeout(5)
        try:
            conn, _ = server.accept()
            conn.sendall(b"pong\n")
            conn.close()
        except OSError:
            pass

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "print(s.recv(10).decode().strip())")
    try:
        assert compute_score(code, gt("pong"), CFG)["score"] == 0.0
        r = Sandbox(isolation="namespaces").run(code, "", LIMITS)
        assert r.status == "error" and ("ConnectionRefused" in r.stderr or "unreachable" in r.stderr), r.stderr
    finally:
        server.close()


@needs_ns
def test_cannot_kill_its_parent_or_the_trainer():
    me = os.getpid()
    code = (f"import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n    pass\n"
            f"os.kill({me}, signal.SIGKILL)\nprint('killed')")
    r = Sandbox(isolation="namespaces").run(code, "", LIMITS)
    assert r.status == "error" and "killed" not in r.stdout
    assert compute_score(code, gt("killed"), CFG)["score"] == 0.0
    assert os.getpid() == me  # still here


@needs_ns
def test_writes_stay_inside_the_sandbox_folder(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.chdir(run_dir)
    tag = uuid.uuid4().hex
    targets = [str(run_dir / f"escape-{tag}"), f"/tmp/escape-{tag}", f"/var/tmp/escape-{tag}",
               f"/dev/shm/escape-{tag}", os.path.expanduser(f"~/escape-{tag}"), f"../escape-{tag}"]
    before = set(os.listdir(run_dir))
    box = Sandbox(isolation="namespaces")
    for target in targets:
        r = box.run(f"open({target!r}, 'w').write('x')", "", LIMITS)
        assert r.status in ("ok", "error")  # ok: it wrote into its own tmpfs, which vanished with it
    for target in targets:
        host_path = target if target.startswith("/") else os.path.join(tmp_path, target[3:])
        assert not os.path.exists(host_path), host_path
    assert set(os.listdir(run_dir)) == before


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="cpu_time_s"):
        SandboxLimits(cpu_time_s=0)
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(isolation="vm")
    with pytest.raises(ValueError, match="max_concurrent"):
        SandboxConfig(max_concurrent=0)
    with pytest.raises(ValueError, match="url"):
        SandboxConfig(url="localhost:8080")


def test_concurrent_runs_are_bounded_and_ordered():
    box = Sandbox(isolation="process", max_concurrent=2)
    jobs = [(f"print({i} * 2)", "", LIMITS) for i in range(8)]
    assert [r.stdout for r in box.run_many(jobs)] == [f"{i * 2}\n" for i in range(8)]
