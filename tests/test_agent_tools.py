"""Tool calls: the Hermes parser on good, malformed and adversarial text; the calculator; the sandboxed pool.

Tools that raise, hang, return something huge, print to stdout, or allocate past the memory limit
become error results (the pool goes on, its workers replaced); each call returns within its
timeout plus the kill grace.
"""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from tinyzero.agent.parser import MAX_CALL_CHARS, ToolCall, ToolCallError, parse_tool_calls


def test_parser_good_calls():
    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 412"}}\n'
            '</tool_call>\nand <tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
            '<tool_call>{"name": "noargs"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "37 * 412"}),
                                      ToolCall("search", {"q": "x"}), ToolCall("noargs", {})]
    assert parse_tool_calls("no calls here, </tool_call> alone") == []


@pytest.mark.parametrize("body, why", [
    ('{"name": "calc", "arguments": {"expression": "1+1"}', "not valid JSON"),
    ("{'name': 'calc'}", "not valid JSON"),
    ("__import__('os').system('echo pwned')", "not valid JSON"),
    ('["calc", {}]', "must be a JSON object"),
    ('{"arguments": {}}', 'lacks a "name"'),
    ('{"name": 3}', 'lacks a "name"'),
    ('{"name": "calc", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
    ('{"name": "calc", "arguments": "not json"}', "is a string that is not a JSON object"),
    ("[" * 100_000 + "]" * 100_000, f"longer than {MAX_CALL_CHARS}"),
    ("[" * 4000 + "]" * 4000, "not valid JSON|must be a JSON object"),
    ('{"name": "calc", "arguments": {"x": NaN}}', "NaN is not JSON"),
    ('{"name": "calc", "arguments": {"x": "' + "y" * MAX_CALL_CHARS + '"}}', f"longer than {MAX_CALL_CHARS}"),
])
def test_parser_malformed_and_adversarial(body, why):
    import re

    out = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert len(out) == 1 and isinstance(out[0], ToolCallError)
    assert re.search(why, out[0].message), out[0].message


def test_parser_unclosed_and_mixed():
    out = parse_tool_calls('<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b"')
    assert out[0] == ToolCall("a", {})
    assert isinstance(out[1], ToolCallError) and "without a closing" in out[1].message


def test_calculator():
    from tinyzero.agent.tools import Calculator, load_tool

    calc = load_tool("calculator")
    assert isinstance(calc, Calculator)
    assert calc.call({"expression": "37 * 412"}) == str(37 * 412)
    assert calc.call({"expression": "(100 - 1) // 4"}) == str((100 - 1) // 4)
    assert calc.call({"expression": "7 / 2"}) == "3.5"
    assert calc.call({"expression": "6 / 2"}) == "3"
    for bad in ({"expression": "__import__('os')"}, {"expression": "2 ** 10"}, {"expression": 5}, {}):
        with pytest.raises(ValueError):
            calc.call(bad)


TOOLS_FILE = '''
import sys, time


class Boom:
    name, description, parameters, timeout_s = "boom", "raises", {"type": "object"}, 5.0

    def call(self, args):
        raise RuntimeError("kaboom " + str(args.get("why")))


class Hang:
    name, description, parameters, timeout_s = "hang", "never returns", {"type": "object"}, 0.5

    def call(self, args):
        try:
            while True:
                time.sleep(0.05)
        except BaseException:  # even a bare except cannot stop a kill
            while True:
                time.sleep(0.05)


class Huge:
    name, description, parameters, timeout_s = "huge", "huge output", {"type": "object"}, 5.0

    def call(self, args):
        print("noise on stdout must not corrupt the pipe")
        return "x" * 5_000_000


class Hog:
    name, description, parameters, timeout_s = "hog", "allocates", {"type": "object"}, 5.0

    def call(self, args):
        return str(len(bytearray(2 * 1024**3)))


class Crash:
    name, description, parameters, timeout_s = "crash", "exits", {"type": "object"}, 5.0

    def call(self, args):
        import os
        os._exit(3)


class Echo:
    name, description, parameters, timeout_s = "echo", "echo", {"type": "object"}, 5.0

    def call(self, args):
        return args
'''


@pytest.fixture(scope="module")
def tool_specs(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(textwrap.dedent(TOOLS_FILE))
    return ["calculator"] + [f"{path}:{name}" for name in ("Boom", "Hang", "Huge", "Hog", "Crash", "Echo")]


def test_load_tool_errors(tmp_path):
    from tinyzero.agent.tools import load_tool

    with pytest.raises(ValueError, match="unknown name 'nope'"):
        load_tool("nope")
    with pytest.raises(ValueError, match="rollout.multi_turn.tools: file .* does not exist"):
        load_tool(str(tmp_path / "missing.py") + ":X")
    bad = tmp_path / "bad.py"
    bad.write_text("class X:\n    name = 'x'\n")
    with pytest.raises(ValueError, match="lacks"):
        load_tool(f"{bad}:X")


def test_pool_survives_misbehaving_tools(tool_specs, capsys):
    from tinyzero.agent.pool import ToolPool

    pool = ToolPool(tool_specs, num_workers=2, memory_mb=256, max_chars=100, kill_grace_s=0.5)
    try:
        calls = [("calculator", {"expression": "37*412"}, 2.0), ("boom", {"why": 1}, 5.0), ("hang", {}, 0.5),
                 ("huge", {}, 5.0), ("hog", {}, 5.0), ("crash", {}, 5.0), ("echo", {"a": [1]}, 5.0),
                 ("nope", {}, 5.0)]
        start = time.monotonic()
        res = pool.run(calls)
        elapsed = time.monotonic() - start
        assert res[0].text == str(37 * 412) and not res[0].error
        assert res[1].error and "RuntimeError: kaboom 1" in res[1].text
        assert res[2].error and res[2].timeout and "timed out after 0.5 s" in res[2].text
        assert not res[3].error and res[3].text.startswith("x" * 100)
        assert res[3].text.endswith(f"[truncated {5_000_000 - 100} characters]")
        assert res[4].error and "out of memory" in res[4].text
        assert res[5].error and "died (exit code 3)" in res[5].text
        assert not res[6].error and res[6].text == str({"a": [1]})
        assert res[7].error and "unknown tool 'nope'" in res[7].text
        assert elapsed < 30, elapsed  # the hang is cut at 0.5 s + grace, not waited out
        # Each failure the run survives is also said once on the console, naming the tool and the fix.
        err = capsys.readouterr().err.splitlines()
        assert any("tool 'hang' ran past its time limit of 0.5 s" in line for line in err), err
        assert any("tool 'hog' ran out of memory (rollout.multi_turn.tool_memory_mb)" in line for line in err), err
        assert any("tool 'crash' crashed: its process ended (exit code 3)" in line for line in err), err
        assert not any("'boom'" in line or "'nope'" in line for line in err), err  # the model's own errors: metrics only
        # The pool goes on after killing and replacing workers.
        again = pool.run([("calculator", {"expression": "2*21"}, 2.0)] * 3)
        assert [r.text for r in again] == ["42"] * 3
    finally:
        pool.close()


def test_failure_notices_are_rate_limited(capsys, monkeypatch):
    from tinyzero.agent import pool

    clock = [100.0]
    monkeypatch.setattr(pool.time, "monotonic", lambda: clock[0])
    notices = pool.FailureNotices(every_s=60)
    assert "tool 'hang' ran past" in notices.note("hang", "timeout", "2 s")
    assert notices.note("hang", "timeout", "2 s") is None and notices.note("hang", "timeout", "2 s") is None
    assert "tool 'hang' crashed" in notices.note("hang", "died", "killed by SIGSEGV")  # another kind: its own line
    clock[0] += 61
    line = notices.note("hang", "timeout", "2 s")
    assert "(3 such calls in the last 61 s)" in line, line
    assert len(capsys.readouterr().err.splitlines()) == 3
    assert pool._exit_text(-11) == "killed by SIGSEGV" and pool._exit_text(3) == "exit code 3"


def test_pool_start_error_names_the_tool(tmp_path):
    from tinyzero.agent.pool import ToolPool

    path = tmp_path / "broken.py"
    path.write_text("raise ImportError('missing dependency foo')\n")
    pool = ToolPool([f"{path}:X"], num_workers=1)
    with pytest.raises(ValueError, match=r"a tool worker could not load rollout\.multi_turn\.tools: .*broken\.py. failed with ImportError: missing dependency foo"):
        pool.run([("x", {}, 1.0)])
    pool.close()


def test_config_validation():
    from tinyzero.rollout.multi_turn import MultiTurnConfig

    assert MultiTurnConfig(enable=True, tools="calculator,x.py:Y").tools == ["calculator", "x.py:Y"]
    for kwargs, field in [({"enable": True}, "multi_turn.tools"), ({"max_turns": 0}, "max_turns"),
                          ({"tool_timeout_s": 0}, "tool_timeout_s"), ({"num_tool_workers": 0}, "num_tool_workers"),
                          ({"tools": ["calculator"], "environment": "e"}, "not both")]:
        with pytest.raises(ValueError, match=field):
            MultiTurnConfig(**kwargs)
    json.dumps(MultiTurnConfig().__dict__)  # plain values (written into config.yaml)
