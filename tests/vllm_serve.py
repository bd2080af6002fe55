"""`vllm serve` for tests: start the OpenAI-compatible server on a free local port, wait until healthy, stop it.

    with vllm_serve(model_dir, ["--dtype", "float32", ...], log_path) as url:
        ...   # url: http://127.0.0.1:<port>

The server runs in its own session and is stopped with its whole process group (SIGTERM, then SIGKILL).
A server that exits or is not healthy within start_timeout_s fails the test with the end of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.dist_utils import free_port


@contextlib.contextmanager
def vllm_serve(model_dir: str, args: list[str], log_path, env: dict | None = None, start_timeout_s: float = 400):
    port = free_port()
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", **(env or {}))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    log = open(log_path, "w+")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve did not become healthy in {start_timeout_s:g} s")
                time.sleep(1)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
