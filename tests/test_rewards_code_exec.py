"""The code scorer: veRL's extraction and test formats, exact scores, and the SandboxFusion backend against a
real HTTP server (run_code, answered by running the code in the local sandbox)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tinyzero.rewards.code_exec import compute_score, extract_program, parse_tests, stdout_matches
from tinyzero.rewards.registry import get_scorer
from tinyzero.rewards.sandbox_config import SandboxConfig
from tinyzero.runtime.sandbox import Sandbox, SandboxLimits

CFG = SandboxConfig(timeout_s=1, wall_timeout_s=3, memory_limit_mb=256)
DOUBLE = {"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["2\n", "4\n", "6\n", "8\n"]}


def test_extraction_follows_verls_fence_rules():
    assert extract_program("a\n```python\nx=1\n```\nb\n```python\ny=2\n```") == ("\ny=2\n", True)
    assert extract_program("```py\nz=3\n```") == ("z=3\n", True)
    assert extract_program("<think>```python\nbad\n```</think>print(1)") == ("print(1)", False)


def test_stdout_rule():
    assert stdout_matches("1 2\n3  \n\n", "1 2\n3")
    assert stdout_matches("0.3333333\n", "0.33333333")
    assert not stdout_matches("0.34\n", "0.33")
    assert stdout_matches("a\nb\n", ["a", "b"])
    assert not stdout_matches("a b c", "a b")


@pytest.mark.parametrize("continuous,expected", [(True, 0.5), (False, 0.0)])
def test_stdin_programs_score_exactly(continuous, expected):
    cfg = SandboxConfig(**{**CFG.__dict__, "continuous": continuous})
    right = compute_score("```python\nprint(int(input()) * 2)\n```", json.dumps(DOUBLE), cfg)
    assert right == {"score": 1.0, "acc": True, "formatted": True, "passed": 4, "num_tests": 4}
    half = compute_score("n = int(input())\nprint(n * 2 if n < 3 else -1)", DOUBLE, cfg)
    assert half["score"] == expected and not half["acc"]
    wrong = compute_score("print(0)", DOUBLE, cfg)
    assert wrong["score"] == 0.0 and wrong["formatted"]
    broken = compute_score("print(int(input()) * 2", DOUBLE, cfg)
    assert broken["score"] == 0.0 and not broken["formatted"]


def test_call_based_programs_score_exactly():
    tests = {"fn_name": "f", "inputs": [[1], [2], [3]], "outputs": [2, 4, 7]}
    assert compute_score("def f(x): return 2 * x", tests, CFG)["score"] == pytest.approx(2 / 3, abs=1e-12)
    assert compute_score("def f(x): return x + x + (x == 3)", tests, CFG)["score"] == 1.0
    loop = compute_score("def f(x):\n    while x != 2:\n        pass\n    return 4", tests, CFG)
    assert loop["passed"] == 1
    # prime_code's form: one JSON value per input line, JSON-string outputs; a LeetCode-style class
    lines = {"fn_name": "twoSum", "inputs": ["[2, 7, 11]\n9", "[1, 3]\n4"], "outputs": ["[0, 1]", "[0, 1]"]}
    solution = ("class Solution:\n    def twoSum(self, nums: List[int], t: int) -> List[int]:\n"
                "        return [0, 1] if nums[0] + nums[1] == t else []")
    assert compute_score(solution, lines, CFG)["score"] == 1.0
    apps = {"fn_name": "g", "inputs": [["ab"]], "outputs": [["AB"]]}  # APPS stores [answer]
    assert compute_score("def g(s): return s.upper()", apps, CFG)["score"] == 1.0


def test_only_the_first_max_tests_count_when_continuous():
    tests = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{i}\n" for i in range(10)] + ["x\n", "y\n"]}
    assert compute_score("print(input())", tests, CFG)["score"] == 1.0
    assert compute_score("print(input())", tests, SandboxConfig(**{**CFG.__dict__, "max_tests": None}))[
        "score"] == pytest.approx(10 / 12, abs=1e-12)


def test_malformed_ground_truth_names_the_problem():
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_tests("{inputs")
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        parse_tests({"inputs": ["1", "2"], "outputs": ["1"]})
    with pytest.raises(ValueError, match="fn_name"):
        parse_tests({"inputs": ["1"], "outputs": ["1"], "fn_name": "f(x)"})


def test_registered_for_verls_code_sources():
    for source in ("codecontests", "apps", "codeforces", "taco"):
        assert get_scorer(source)("print(input())", {"inputs": ["a"], "outputs": ["a"]}, None, sandbox=CFG)[
            "score"] == 1.0


class _RunCode(BaseHTTPRequestHandler):
    """SandboxFusion's run_code, answered by running the code in the local sandbox."""

    box = Sandbox(isolation="auto")
    fail_first = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).fail_first > 0:
            type(self).fail_first -= 1
            self.send_response(503)
            self.end_headers()
            return
        limits = SandboxLimits(cpu_time_s=float(req["run_timeout"]), wall_time_s=float(req["run_timeout"]) + 1,
                               memory_mb=int(req.get("memory_limit_MB", 1024)))
        r = self.box.run(req["code"], req.get("stdin", ""), limits)
        run = {"status": "TimeLimitExceeded" if r.status == "timeout" else "Finished", "return_code": r.returncode,
               "stdout": r.stdout, "stderr": r.stderr, "execution_time": r.wall_s}
        body = json.dumps({"status": "Success" if r.status == "ok" else "Failed", "message": "",
                           "compile_result": None, "run_result": run}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fusion_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RunCode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    server.shutdown()
    server.server_close()


def test_sandbox_fusion_backend_scores_like_the_local_sandbox(fusion_url):
    cfg = SandboxConfig(**{**CFG.__dict__, "url": fusion_url, "num_retries": 3})
    for code, tests in (("print(int(input()) * 2)", DOUBLE), ("n = int(input())\nprint(n * 2 if n < 3 else 0)", DOUBLE),
                        ("def f(x): return 2 * x", {"fn_name": "f", "inputs": [[1], [5]], "outputs": [2, 9]})):
        assert compute_score(code, tests, cfg) == compute_score(code, tests, CFG)
    _RunCode.fail_first = 2  # retried past two 503 answers
    assert compute_score("print(int(input()) + 100)", {"inputs": ["1"], "outputs": ["101"]}, cfg)["score"] == 1.0


def test_sandbox_fusion_unreachable_raises_not_zero():
    cfg = SandboxConfig(**{**CFG.__dict__, "url": "http://127.0.0.1:9/run_code", "num_retries": 2})
    with pytest.raises(RuntimeError, match="SandboxFusion server .* failed after 2 attempt"):
        compute_score("print(1)", {"inputs": [""], "outputs": ["1"]}, cfg)


def _run(code: str, x: int):
    """f(x) of a one-line program, run in this process (the reference the sandbox scores are checked against)."""
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the programs are the task's own, written by code_tasks.program
    return scope["f"](x)


def test_code_tasks_reward_the_right_program_only():
    # Every program "x<op>c" with a constant from 1 to 11 (the warm-up's range) passes no call unless it is
    # the answer: a partial score for a wrong operator would be a shortcut for the policy.
    from tinyzero.data.preprocess.code_tasks import OPS, TEST_INPUTS, ground_truth, problems, program

    for op, k in problems():
        tests = json.loads(ground_truth(op, k))
        for other in OPS:
            for c in range(1, 12):
                passed = sum(_run(program(other, c), x) == y for (x,), y in zip(tests["inputs"], tests["outputs"]))
                assert passed == (len(TEST_INPUTS) if (other, c) == (op, k) else 0), (op, k, other, c)
    for op, k in (("add", 3), ("sub", 9), ("mul", 4)):
        assert compute_score(program(op, k), ground_truth(op, k), CFG)["score"] == 1.0
        assert compute_score(program(op, k + 1), ground_truth(op, k), CFG)["score"] == 0.0


def test_code_tasks_warm_up_teaches_the_format_not_the_answer(tmp_path):
    import re

    import pyarrow.parquet as pq

    from tinyzero.data.preprocess.code_tasks import OPS, build_data, problems

    build_data(str(tmp_path), seed=0)
    test = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert sorted(r["prompt"][0]["content"] for r in test) == sorted(f"{op} {k}:" for op, k in problems())
    sft = pq.read_table(tmp_path / "sft.parquet").to_pylist()
    assert len(sft) == 16 * len(problems())
    offsets = set()
    for row in sft:
        op, k = re.fullmatch(r"(\w+) (\d+):", row["prompt"][0]["content"]).groups()
        sym, c = re.fullmatch(r"def f\(x\):return x([-+*])(\d+)", row["response"]).groups()
        assert sym == OPS[op], row
        offsets.add(int(c) - int(k))
    assert offsets == {1, 2}  # the right constant (offset 0) never appears
