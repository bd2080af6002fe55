"""tinyzero.runtime.subprocess_pool on a real worker module: messages round-trip, a hung message is
killed at its limit and its worker replaced, a crashed worker is replaced and reported, the budget
stops a batch, and a worker that cannot start raises instead of hanging."""

from __future__ import annotations

import io
import os
import signal
import textwrap
import time

import pytest

from tinyzero.runtime.subprocess_pool import Outcome, SubprocessPool, read_message, write_message

WORKER = textwrap.dedent("""
    import os, signal, time

    from tinyzero.runtime.subprocess_pool import serve


    def setup(settings):
        if settings == "fail":
            raise RuntimeError("missing dependency foo")
        if settings == "slow start":
            time.sleep(60)
        tag = settings

        def handle(message):
            op, arg = message
            if op == "echo":
                print("a print must not reach the answer pipe")
                return (tag, arg)
            if op == "sleep":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                time.sleep(arg)
                return (tag, "woke")
            if op == "exit":
                os._exit(arg)
            if op == "signal":
                os.kill(os.getpid(), arg)
            if op == "pid":
                return (tag, os.getpid())
            raise AssertionError(op)

        return handle


    if __name__ == "__main__":
        serve(setup)
""")


@pytest.fixture
def module(tmp_path, monkeypatch):
    """The test worker, importable by the children (the pool hands them this process's sys.path)."""
    (tmp_path / "pool_test_worker.py").write_text(WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "pool_test_worker"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_framing_round_trips_and_reports_a_closed_pipe():
    values = [None, 0, "text", {"a": [1, 2.5, (3, b"\x00\xff")]}, b"x" * 300_000]
    stream = io.BytesIO()
    for value in values:
        write_message(stream, value)
    stream.seek(0)
    assert [read_message(stream) for _ in values] == values
    with pytest.raises(EOFError):
        read_message(stream)  # nothing left
    cut = io.BytesIO()
    write_message(cut, values[-1])
    with pytest.raises(EOFError, match="mid-message"):
        read_message(io.BytesIO(cut.getvalue()[:100]))  # the header promises more than came


def test_messages_round_trip_in_order(module):
    pool = SubprocessPool(module, "w", num_workers=2)
    try:
        payloads = [i if i % 3 else {"i": i, "blob": b"y" * 100_000, "nested": [[i] * 3]} for i in range(12)]
        seen = []
        outcomes = pool.run([("echo", p) for p in payloads], [30.0] * 12,
                            on_outcome=lambda k, o: seen.append(k))
        assert outcomes == [Outcome("done", reply=("w", p)) for p in payloads]
        assert sorted(seen) == list(range(12))
        pids = {o.reply[1] for o in pool.run([("pid", None)] * 6)}  # no limits: none needed
        assert 1 <= len(pids) <= 2 and all(not _gone(p) for p in pids)
    finally:
        pool.close()
    assert all(_gone(p) for p in pids)  # close() stops and reaps them


def test_a_hung_message_is_killed_at_its_limit_and_its_worker_replaced(module):
    pool = SubprocessPool(module, "w", num_workers=1, kill_grace_s=0.3)
    try:
        (before,) = [o.reply[1] for o in pool.run([("pid", None)])]
        start = time.monotonic()
        outcomes = pool.run([("sleep", 60), ("echo", 1)], [0.5, 30.0])
        elapsed = time.monotonic() - start
        assert outcomes == [Outcome("timeout"), Outcome("done", reply=("w", 1))]
        assert 0.8 <= elapsed < 15, elapsed  # limit 0.5 s + grace 0.3 s, plus one worker start
        assert _gone(before)  # SIGKILL: ignoring SIGTERM did not save it
        (after,) = [o.reply[1] for o in pool.run([("pid", None)])]
        assert after != before
        # A message that finishes inside its limit is not killed.
        assert pool.run([("sleep", 0.2)], [5.0]) == [Outcome("done", reply=("w", "woke"))]
    finally:
        pool.close()


def test_a_crashed_worker_is_reported_and_replaced(module):
    pool = SubprocessPool(module, "w", num_workers=2)
    try:
        reported = {}
        messages = [("echo", "a"), ("exit", 3), ("signal", signal.SIGKILL), ("echo", "b"), ("echo", "c")]
        outcomes = pool.run(messages, [30.0] * len(messages), on_outcome=reported.__setitem__)
        assert outcomes == [Outcome("done", reply=("w", "a")), Outcome("died", exit_code=3),
                            Outcome("died", exit_code=-signal.SIGKILL), Outcome("done", reply=("w", "b")),
                            Outcome("done", reply=("w", "c"))]
        assert reported == dict(enumerate(outcomes))
        assert [o.reply for o in pool.run([("echo", i) for i in range(4)], [30.0] * 4)] == [("w", i) for i in range(4)]
    finally:
        pool.close()


def test_the_budget_stops_a_batch(module):
    pool = SubprocessPool(module, "w", num_workers=2)
    try:
        reported = []
        start = time.monotonic()
        outcomes = pool.run([("sleep", 60)] * 4, budget_s=0.5, on_outcome=lambda k, o: reported.append(k))
        assert time.monotonic() - start < 15
        assert [o.status for o in outcomes] == ["in_flight"] * 2 + ["not_started"] * 2
        assert reported == []
        assert pool.run([("echo", 1)]) == [Outcome("done", reply=("w", 1))]
    finally:
        pool.close()


def test_a_worker_that_cannot_start_raises(module):
    pool = SubprocessPool(module, "fail", num_workers=1, name="a test worker", loads="test.settings")
    with pytest.raises(ValueError, match=r"a test worker could not load test\.settings: RuntimeError: missing "
                                         r"dependency foo"):
        pool.run([("echo", 1)])
    pool.close()
    pool = SubprocessPool(module, "slow start", num_workers=1, ready_timeout_s=1.0, name="a test worker")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="a test worker did not start within 1 s"):
        pool.run([("echo", 1)])
    assert time.monotonic() - start < 15
    pool.close()
    with pytest.raises(ValueError, match="num_workers >= 1"):
        SubprocessPool(module, None, num_workers=0)


def test_a_call_that_raises_leaves_no_answer_for_the_next(module):
    pool = SubprocessPool(module, "w", num_workers=2)

    def stop(k, outcome):
        raise KeyboardInterrupt  # as if Ctrl-C came while the other worker was busy

    try:
        with pytest.raises(KeyboardInterrupt):
            pool.run([("echo", 1), ("sleep", 1.0)], on_outcome=stop)
        assert pool.run([("echo", "x"), ("echo", "y")]) == [Outcome("done", reply=("w", "x")),
                                                           Outcome("done", reply=("w", "y"))]
    finally:
        pool.close()
