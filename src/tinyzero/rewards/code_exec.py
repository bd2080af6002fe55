"""Code rewards by execution: veRL's codecontests / apps / codeforces / taco data, scored by running the program.

    from tinyzero.rewards.code_exec import compute_score
    compute_score("```python\\nprint(int(input()) + 1)\\n```", '{"inputs": ["1\\n"], "outputs": ["2\\n"]}')
    # {"score": 1.0, "acc": True, "formatted": True, "passed": 1, "num_tests": 1}

The program is taken from the response as veRL does: <think>...</think> removed, then the text
of the last ```python block, else of the first ``` block (without a language word on its first
line), else the whole response. The ground truth is veRL's: a dict or a JSON string with
"inputs" and "outputs" lists of the same length, and optionally "fn_name".
  - standard input (no fn_name): each test runs the program once with the input on stdin
    (a list of lines is joined with newlines); it passes when the program exits 0 and its stdout
    matches the output: the same lines after trailing whitespace and trailing empty lines are
    dropped, or else the same whitespace-separated tokens where numeric tokens may differ by
    1e-6 (absolute, or relative to the expected value).
  - call-based (fn_name): one run calls fn_name (a function of the program, or a method of its
    class Solution) once per test, each call under the per-test time limit; the arguments are the
    test's input (a list of arguments, or a string with one JSON value per line), and it passes
    when the JSON of the result equals the expected value (a JSON string when the input is a
    string), or its first element when the expected value is a non-empty list (APPS stores
    [answer]). Common imports (typing, math, collections, ...) are in scope, as in veRL's harness.
Score: with `continuous` (veRL's setting for these sources), the fraction of the first
`max_tests` tests passed; otherwise 1.0 when every test passes, else 0. "acc" is every test
passed; "formatted" is the program compiled. A malformed ground truth raises (reward.on_error);
a sandbox that fails to run (not the program) raises too, so infrastructure faults never read
as a model's 0.

Programs run in tinyzero.runtime.sandbox, or on a SandboxFusion server (`reward.sandbox.url`).
Identical (program, tests, limits) are run once per process (an LRU cache): a GRPO group often
samples the same program several times.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from tinyzero.rewards.sandbox_config import SandboxConfig
from tinyzero.runtime.sandbox import RunResult, SandboxLimits, get_sandbox

__all__ = ["CODE_DATA_SOURCES", "compute_score", "extract_program", "parse_tests", "stdout_matches",
           "SandboxFusionClient"]

CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
"""veRL's data sources scored by running code."""

_MARK = "@@tinyzero-result@@"
_COMPILE_ERROR = "@@tinyzero-compile-error@@"
_HEADER = ("from typing import *\nimport bisect, collections, functools, heapq, itertools, math, operator, re, "
           "string, sys\nfrom collections import *\nfrom math import *\nfrom itertools import *\n"
           "from functools import *\nfrom heapq import *\nfrom bisect import *\n")
_CACHE_SIZE = 4096
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def extract_program(response: str) -> tuple[str, bool]:
    """(program text, whether it came from a fenced block), by veRL's rules (see the module docstring)."""
    text = _THINK.sub("", response)
    if "```python" in text:
        return text.split("```python")[-1].split("```")[0], True
    if "```" in text:
        block = text.split("```")[1]
        first, sep, rest = block.partition("\n")
        if sep and first.strip().isalpha():
            block = rest
        return block, True
    return text, False


def parse_tests(ground_truth) -> dict:
    """veRL's test cases as {"inputs", "outputs", "fn_name"}; ValueError naming what is wrong."""
    tests = ground_truth
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise ValueError(f"code ground_truth is not valid JSON ({e}); expected a JSON object with "
                             "'inputs' and 'outputs' lists (and optionally 'fn_name')") from None
    if not isinstance(tests, dict) or not isinstance(tests.get("inputs"), list) \
            or not isinstance(tests.get("outputs"), list):
        raise ValueError(f"code ground_truth must hold 'inputs' and 'outputs' lists, got {str(tests)[:200]!r}")
    if len(tests["inputs"]) != len(tests["outputs"]):
        raise ValueError(f"code ground_truth has {len(tests['inputs'])} inputs but {len(tests['outputs'])} outputs; "
                         "they must pair up")
    if not tests["inputs"]:
        raise ValueError("code ground_truth has no test cases (empty 'inputs')")
    fn_name = tests.get("fn_name")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise ValueError(f"code ground_truth fn_name must be a Python identifier, got {fn_name!r}")
    return {"inputs": tests["inputs"], "outputs": tests["outputs"], "fn_name": fn_name}


def _lines(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _number(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def stdout_matches(actual: str, expected) -> bool:
    """The stdout comparison rule (see the module docstring)."""
    if isinstance(expected, list):
        expected = "\n".join(str(x) for x in expected)
    expected = str(expected)
    if _lines(actual) == _lines(expected):
        return True
    got, want = actual.split(), expected.split()
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g == w:
            continue
        gv, wv = _number(g), _number(w)
        if gv is None or wv is None or abs(gv - wv) > 1e-6 * max(1.0, abs(wv)):
            return False
    return True


def _stdin_program(code: str) -> str:
    """The program for a standard-input test: compile errors are marked on stderr, then it runs as __main__."""
    return (f"import sys as _tz_sys\n_tz_src = {code!r}\ntry:\n    _tz_code = compile(_tz_src, 'solution.py', 'exec')\n"
            f"except (SyntaxError, ValueError) as _tz_e:\n    print({_COMPILE_ERROR!r}, repr(_tz_e), file=_tz_sys.stderr)\n"
            f"    raise SystemExit(3)\ndel _tz_src\nexec(_tz_code, {{'__name__': '__main__'}})\n")


def _call_program(code: str, fn_name: str, args: list, timeout_s: float) -> str:
    """The program for call-based tests: loads the solution, then one timed call per test, each result a
    marked JSON line on stdout (expected values never enter the program)."""
    return f"""import json as _tz_json, signal as _tz_signal, sys as _tz_sys
_tz_out = _tz_sys.stdout
def _tz_alarm(signum, frame):
    raise TimeoutError('time limit per call')
_tz_signal.signal(_tz_signal.SIGALRM, _tz_alarm)
try:
    _tz_code = compile({(_HEADER + code)!r}, 'solution.py', 'exec')
except (SyntaxError, ValueError) as _tz_e:
    print({_COMPILE_ERROR!r}, repr(_tz_e), file=_tz_sys.stderr)
    raise SystemExit(3)
_tz_g = {{'__name__': 'solution'}}
_tz_signal.setitimer(_tz_signal.ITIMER_REAL, {timeout_s!r})
try:
    exec(_tz_code, _tz_g)
finally:
    _tz_signal.setitimer(_tz_signal.ITIMER_REAL, 0)
_tz_cls = _tz_g.get('Solution')
_tz_fn = getattr(_tz_cls(), {fn_name!r}) if isinstance(_tz_cls, type) and hasattr(_tz_cls, {fn_name!r}) \\
    else _tz_g.get({fn_name!r})
for _tz_i, _tz_args in enumerate(_tz_json.loads({json.dumps(args)!r})):
    _tz_signal.setitimer(_tz_signal.ITIMER_REAL, {timeout_s!r})
    try:
        _tz_line = _tz_json.dumps({{'i': _tz_i, 'out': _tz_fn(*_tz_args)}})
    except BaseException as _tz_e:
        _tz_line = _tz_json.dumps({{'i': _tz_i, 'error': type(_tz_e).__name__}})
    finally:
        _tz_signal.setitimer(_tz_signal.ITIMER_REAL, 0)
    _tz_out.write('\\n' + {_MARK!r} + _tz_line + '\\n')
    _tz_out.flush()
"""


def _call_args(test_input) -> list:
    if isinstance(test_input, str):
        return [json.loads(line) for line in test_input.strip().split("\n")]
    if isinstance(test_input, list):
        return test_input
    return [test_input]


def _call_passes(out, expected, input_was_text: bool) -> bool:
    if input_was_text and isinstance(expected, str):
        try:
            expected = json.loads(expected)
        except json.JSONDecodeError:
            pass
    return out == expected or (isinstance(expected, list) and bool(expected) and out == expected[0])


class SandboxFusionClient:
    """Runs programs on a SandboxFusion server (its run_code API), max_concurrent requests at a time,
    each retried on a connection error, a timeout, HTTP 429 or 5xx; a run that still fails is a
    "sandbox_error" naming the server and the last error."""

    def __init__(self, cfg: SandboxConfig):
        self.cfg = cfg
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_concurrent, thread_name_prefix="sandbox-fusion")

    def _post(self, payload: dict, timeout: float) -> dict:
        req = urllib.request.Request(self.cfg.url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def run(self, code: str, stdin: str, limits: SandboxLimits) -> RunResult:
        payload = {"code": code, "stdin": stdin, "language": "python", "compile_timeout": limits.cpu_time_s,
                   "run_timeout": limits.wall_time_s, "memory_limit_MB": limits.memory_mb, "files": {},
                   "fetch_files": []}
        start, last = time.monotonic(), ""
        for attempt in range(self.cfg.num_retries):
            try:
                answer = self._post(payload, limits.wall_time_s + self.cfg.request_timeout_s)
                return _fusion_result(answer, time.monotonic() - start, limits.max_output_bytes)
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
                if e.code != 429 and e.code < 500:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt + 1 < self.cfg.num_retries:
                time.sleep(min(0.5 * 2 ** attempt, 8.0))
        return RunResult("sandbox_error", None, "", f"SandboxFusion server {self.cfg.url} failed after "
                         f"{attempt + 1} attempt(s): {last}", time.monotonic() - start)

    def run_many(self, jobs: list[tuple[str, str, SandboxLimits]], stop_on_failure: bool = False) -> list[RunResult]:
        return list(self._pool.map(lambda job: self.run(*job), jobs))


def _fusion_result(answer: dict, wall: float, max_bytes: int) -> RunResult:
    """A run_code answer as a RunResult."""
    status = answer.get("status")
    run = answer.get("run_result") or {}
    out, err = str(run.get("stdout") or "")[:max_bytes], str(run.get("stderr") or "")[:max_bytes]
    if status == "SandboxError" or status not in ("Success", "Failed"):
        return RunResult("sandbox_error", None, out, f"SandboxFusion status {status!r}: {answer.get('message')}", wall)
    if run.get("status") == "TimeLimitExceeded":
        return RunResult("timeout", None, out, err, wall)
    code = run.get("return_code")
    ok = status == "Success" and run.get("status") == "Finished" and code == 0
    return RunResult("ok" if ok else "error", code, out, err, wall)


_CLIENTS: dict[tuple, SandboxFusionClient] = {}
_CACHE: OrderedDict = OrderedDict()
_LOCK = threading.Lock()


def _backend(cfg: SandboxConfig):
    if cfg.url is None:
        return get_sandbox(cfg.isolation, cfg.max_concurrent, cfg.uid_base, tuple(cfg.hide_paths))
    key = (cfg.url, cfg.max_concurrent, cfg.num_retries, cfg.request_timeout_s)
    with _LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = SandboxFusionClient(cfg)
        return _CLIENTS[key]


def _limits(cfg: SandboxConfig, cpu_time_s: float) -> SandboxLimits:
    wall = cfg.wall_timeout_s if cfg.wall_timeout_s is not None else 2 * cpu_time_s + 1
    return SandboxLimits(cpu_time_s=cpu_time_s, wall_time_s=wall, memory_mb=cfg.memory_limit_mb,
                         file_size_mb=cfg.file_size_mb, max_open_files=cfg.max_open_files,
                         max_processes=cfg.max_processes, max_output_bytes=cfg.max_output_bytes)


def _check_runs(results: list[RunResult]) -> None:
    for r in results:
        if r.status == "sandbox_error" and r.stderr != "[skipped]":
            raise RuntimeError(f"the code sandbox failed (not the program): {r.stderr.strip()[-500:]}")


def _run_tests(code: str, tests: dict, cfg: SandboxConfig, continuous: bool) -> tuple[list[bool], bool]:
    """(passed per test, compiled)."""
    backend = _backend(cfg)
    inputs, outputs = tests["inputs"], tests["outputs"]
    if tests["fn_name"] is None:
        limits = _limits(cfg, cfg.timeout_s)
        stdins = ["\n".join(str(x) for x in t) if isinstance(t, list) else str(t) for t in inputs]
        program = _stdin_program(code)
        runs = backend.run_many([(program, s, limits) for s in stdins], stop_on_failure=not continuous)
        _check_runs(runs)
        passed = [r.status == "ok" and stdout_matches(r.stdout, want) for r, want in zip(runs, outputs)]
        return passed, not any(_COMPILE_ERROR in r.stderr for r in runs)
    try:
        args = [_call_args(t) for t in inputs]
    except json.JSONDecodeError as e:
        raise ValueError(f"code ground_truth: a call-based input is not one JSON value per line ({e})") from None
    limits = _limits(cfg, cfg.timeout_s * len(args) + 1.0)
    (run,) = backend.run_many([(_call_program(code, tests["fn_name"], args, cfg.timeout_s), "", limits)])
    _check_runs([run])
    got: dict[int, dict] = {}
    for line in run.stdout.split("\n"):
        if line.startswith(_MARK):
            try:
                item = json.loads(line[len(_MARK):])
                got[int(item["i"])] = item
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    passed = [i in got and "out" in got[i] and _call_passes(got[i]["out"], want, isinstance(inputs[i], str))
              for i, want in enumerate(outputs)]
    return passed, _COMPILE_ERROR not in run.stderr


def compute_score(solution_str: str, ground_truth, sandbox: SandboxConfig | None = None,
                  continuous: bool | None = None) -> dict:
    """Run the response's program on the tests; {"score", "acc", "formatted", "passed", "num_tests"}."""
    cfg = sandbox if sandbox is not None else SandboxConfig()
    continuous = cfg.continuous if continuous is None else continuous
    tests = parse_tests(ground_truth)
    if continuous and cfg.max_tests is not None:
        tests = {**tests, "inputs": tests["inputs"][:cfg.max_tests], "outputs": tests["outputs"][:cfg.max_tests]}
    code, _ = extract_program(solution_str)
    key = (code, json.dumps(tests, sort_keys=True, default=str), continuous, repr(cfg))
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return dict(_CACHE[key])
    if code.strip():
        passed, compiled = _run_tests(code, tests, cfg, continuous)
    else:
        passed, compiled = [False] * len(tests["inputs"]), False
    n = len(passed)
    score = sum(passed) / n if continuous else float(all(passed))
    result = {"score": score, "acc": all(passed), "formatted": compiled, "passed": sum(passed), "num_tests": n}
    with _LOCK:
        _CACHE[key] = result
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return dict(result)
