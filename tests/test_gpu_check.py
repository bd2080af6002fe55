"""scripts/gpu_check.py's dry mode on CPU: the script runs, and nothing that did not run on CUDA reads as ok.

The dry run takes the sections that fit a CI budget (the kernels under the Triton interpreter and the
precision check on the live tiny model); every other section must come back "not_covered" and not
ok, and the summary must be written to its file as well as printed. The status rules are checked on
their own: a section that passed its checks but shows no CUDA use is "failed", never "ok".
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_dry_mode_runs_and_reports_what_it_did_not_cover(tmp_path):
    summary_path = tmp_path / "summary.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry", "--sections", "kernels,precision",
                           "--work", str(tmp_path / "work"), "--summary", str(summary_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(summary_path) as f:
        summary = json.load(f)
    assert printed == summary
    sections = summary["sections"]
    gpu_check = _gpu_check()
    assert set(sections) == set(gpu_check.SECTIONS)
    assert sections["kernels"]["status"] == sections["precision"]["status"] == "dry_passed"
    assert sections["kernels"]["backend"] == "triton"
    assert sections["precision"]["moved_frac"] > 0.9
    for name, s in sections.items():
        assert s["ok"] is False, name  # nothing ran on CUDA
        if name not in ("kernels", "precision"):
            assert s["status"] == "not_covered", (name, s)
    assert summary["ok"] is False and summary["failed"] == []
    assert set(summary["not_covered"]) == set(gpu_check.SECTIONS) - {"kernels", "precision"}


def test_status_needs_proof_of_cuda():
    gpu_check = _gpu_check()
    passed_on_cpu = gpu_check.finish({"failed": [], "on_device": "cpu", "gpu_mem_bytes": 0}, dry=False)
    assert passed_on_cpu["status"] == "failed" and not passed_on_cpu["ok"]
    no_memory = gpu_check.finish({"failed": [], "on_device": "cuda:0", "gpu_mem_bytes": 0}, dry=False)
    assert no_memory["status"] == "failed"
    assert gpu_check.finish({"failed": [], "on_device": "cuda:0", "gpu_mem_bytes": 1 << 20}, dry=False)["ok"]
    assert gpu_check.finish({"failed": ["x"], "on_device": "cuda:0", "gpu_mem_bytes": 1}, dry=False)["status"] == "failed"
    skipped = gpu_check.finish({"not_covered": "vllm is not installed here"}, dry=False)
    assert skipped["status"] == "not_covered" and not skipped["ok"]
    summary = gpu_check.summarize({"a": gpu_check.finish({"failed": [], "on_device": "cuda", "gpu_mem_bytes": 1},
                                                         False), "b": skipped}, 1.0, False)
    assert summary["ok"] is False and summary["not_covered"] == ["b"]
    assert gpu_check.summarize({}, 0.0, False)["ok"] is False


def test_bench_json_comes_from_stdout_only():
    gpu_check = _gpu_check()
    assert gpu_check.last_json('{"a": 1}\n{"b": 2}\nwarning: x\n') == {"b": 2}
    assert gpu_check.last_json("{not json\n") is None
