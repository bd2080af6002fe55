"""HF export from an FSDP2-sharded model: reloads with AutoModelForCausalLM and gives identical logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_utils import run_distributed


def _ids():
    return torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(5))


def _train_and_export(path: str, out_dirs: list[str], max_shard_bytes: list[int]):
    from tinyzero.distributed import init_distributed
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.fsdp import load_sharded_model, make_fsdp_mesh
    from tinyzero.models.hf_export import export_hf
    from tinyzero.models.loading import load_tokenizer

    init_distributed()
    fsdp_cfg = FSDPConfig()
    model = load_sharded_model(ModelConfig(path=path), fsdp_cfg, make_fsdp_mesh(fsdp_cfg, "cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _ids()
    model.train()
    model(input_ids=ids).logits.square().mean().backward()
    optim.step()  # move every weight away from the original checkpoint
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for out_dir, shard_bytes in zip(out_dirs, max_shard_bytes):
        export_hf(model, out_dir, tokenizer=load_tokenizer(path), max_shard_bytes=shard_bytes)
    return logits.numpy()


SHARD_BYTES = [64 * 1024, 2 * 1024**3]  # several files + index / one model.safetensors


@pytest.fixture(scope="module")
def exported(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    outs = [str(root / f"hf_{b}") for b in SHARD_BYTES]
    results = run_distributed(_train_and_export, 2, tiny_model_dir, outs, SHARD_BYTES)
    return root, outs, results


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1])
def test_hf_export_reloads_with_identical_logits(tiny_model_dir, exported, which):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, outs, results = exported
    out, max_shard_bytes = outs[which], SHARD_BYTES[which]
    files = sorted(os.listdir(out))
    assert not any(".tmp-" in f for f in os.listdir(root))
    if max_shard_bytes < 1024**2:
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and all(s in files for s in shards)
        keys = set(index["weight_map"])
    else:
        assert "model.safetensors" in files
        with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
            keys = set(f.keys())
    assert "lm_head.weight" not in keys  # tied: written once, as save_pretrained does
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.eval()
    with torch.no_grad():
        reloaded = model(input_ids=_ids()).logits
        before = original(input_ids=_ids()).logits
    for logits in results:
        torch.testing.assert_close(reloaded, torch.from_numpy(logits), atol=1e-6, rtol=1e-6)
    assert (reloaded - before).abs().max() > 1e-3  # the export holds the trained weights
    tok = AutoTokenizer.from_pretrained(out)
    text = "<answer> (1 + 2) / 3 </answer>"
    assert tok.decode(tok(text)["input_ids"]) == text


_VLLM_SCRIPT = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=4,
          kv_cache_memory_bytes=16 << 20, seed=0, disable_log_stats=True)
prompts = json.loads(sys.argv[2])
out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in out]))
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_hf_export_loads_in_vllm(tmp_path):
    """vLLM loads a multi-file export (tied embeddings, index json) and tokenizes with its tokenizer;
    greedy tokens equal HF generate on the same folder. vLLM's CPU attention needs head_dim >= 32."""
    import subprocess
    import sys

    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinyzero.models.hf_export import export_hf
    from tinyzero.models.loading import load_causal_lm, load_tokenizer
    from tinyzero.models.tiny import build_tiny_model

    src = build_tiny_model(str(tmp_path / "src"), seed=0, num_heads=2, num_kv_heads=1)
    model = load_causal_lm(src)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # sharper logits: greedy decoding far from ties
    out = export_hf(model, str(tmp_path / "hf"), tokenizer=load_tokenizer(src), max_shard_bytes=100_000)
    prompts = ["Using the numbers [3, 5, 8]", "hello\nworld"]
    res = subprocess.run([sys.executable, "-c", _VLLM_SCRIPT, out, json.dumps(prompts)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    vllm_tokens = json.loads(lines[-1][len("RESULT "):])

    tok = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, vllm_tokens):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, min_new_tokens=12)
        assert got == ref[0, ids.shape[1]:].tolist()


def test_value_model_export_round_trip(tiny_model_dir, tmp_path):
    """A critic exported from a plain (single-process) model reloads with its trained head."""
    from tinyzero.models.hf_export import export_hf
    from tinyzero.models.value import checkpoint_has_head, load_value_model

    critic = load_value_model(tiny_model_dir)
    with torch.no_grad():
        critic.score.weight.mul_(3.0)
    out = export_hf(critic, str(tmp_path / "critic_hf"))
    assert checkpoint_has_head(out)
    again = load_value_model(out)
    a, b = dict(again.named_parameters()), dict(critic.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = _ids()
    with torch.no_grad():  # same weights; 1e-6 covers kernel-level summation order differences
        torch.testing.assert_close(again(input_ids=ids).logits, critic(input_ids=ids).logits, atol=1e-6, rtol=1e-6)
