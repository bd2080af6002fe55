"""The rollout-engine interface: the declared protocol, the typed sampling parameters built from
meta_info in one place, the engine registry (a new engine plugs in by name), rollout.name=auto and
the vLLM version check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinyzero.rollout import (
    ENGINES,
    RolloutConfig,
    RolloutEngine,
    SamplingParams,
    build_rollout,
    register_engine,
)
from tinyzero.rollout.engine import sampling_params
from tinyzero.rollout.native import NativeRollout
from tinyzero.rollout.registry import EngineSpec, engine_names, resolve_auto
from tinyzero.rollout.vllm import VLLMRollout

PROTOCOL_METHODS = ("generate_sequences", "update_weights", "sleep", "wake_up", "shutdown", "memory_metrics")


def test_engines_implement_the_protocol(tiny_model_dir):
    engine = build_rollout(RolloutConfig(name="native"), tiny_model_dir, device="cpu")
    assert isinstance(engine, NativeRollout) and isinstance(engine, RolloutEngine)
    for cls in (NativeRollout, VLLMRollout):  # vLLM may be absent: check the class
        missing = [m for m in PROTOCOL_METHODS if not callable(getattr(cls, m, None))]
        assert not missing, (cls.__name__, missing)


class _EchoEngine:
    """A stand-in third engine: responses are the last prompt token repeated (the registry's test)."""

    def __init__(self, config):
        self.config = config

    def generate_sequences(self, prompts):
        from tinyzero.rollout.outputs import build_output, repeat_prompts

        params = sampling_params(self.config, prompts.meta_info, 0, 0)
        ids, mask, pos = repeat_prompts(prompts, params.n)
        responses = ids[:, -1:].repeat(1, params.response_length)
        ones = torch.ones_like(responses)
        return build_output(ids, mask, pos, responses, ones, torch.zeros(responses.shape))

    def update_weights(self, named_tensors):
        return sum(1 for _ in named_tensors)

    def sleep(self):
        pass

    def wake_up(self, tags=None):
        pass

    def shutdown(self):
        pass

    def memory_metrics(self):
        return {}


def test_registry_builds_a_new_engine_by_name(tiny_model_dir):
    from tinyzero.protocol import DataProto

    @register_engine("echo")
    def _build(config, model_path, hf_config, device, dp_rank, load_weights, trust_remote_code):
        return _EchoEngine(config)

    try:
        names = engine_names()
        assert names[:3] == ("auto", "native", "vllm") and "echo" in names
        engine = build_rollout(RolloutConfig(name="echo", n=2, response_length=3), tiny_model_dir, device="cpu")
        assert isinstance(engine, RolloutEngine)
        ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
        mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
        batch = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(1)},
                                    meta_info={"pad_token_id": 0})
        out = engine.generate_sequences(batch)
        assert out.batch["responses"].tolist() == [[6] * 3, [6] * 3, [9] * 3, [9] * 3]
        with pytest.raises(ValueError, match="already registered"):
            register_engine("echo")(_build)
    finally:
        ENGINES.pop("echo", None)
    with pytest.raises(ValueError, match=r"rollout.name='echo' is not one of \('auto', 'native', 'vllm'"):
        RolloutConfig(name="echo")


def test_auto_picks_native_without_gpu_and_vllm_with_one(monkeypatch, capsys):
    assert RolloutConfig(name="auto").name == "auto"  # resolved once at start-up, by the run plan
    if not torch.cuda.is_available():
        lines = []
        assert resolve_auto(lines.append) == "native" and lines == ["rollout.name=auto -> native (no GPU)"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    vllm = ENGINES["vllm"]
    monkeypatch.setitem(ENGINES, "vllm", dataclasses.replace(vllm, unavailable=lambda: "vllm is not importable (x)"))
    lines = []
    assert resolve_auto(lines.append) == "native" and lines == ["rollout.name=auto -> native (vllm is not importable (x))"]
    monkeypatch.setitem(ENGINES, "vllm", EngineSpec("vllm", vllm.build, lambda: None))
    assert resolve_auto(None) == "vllm"


def test_vllm_version_range_is_checked():
    from tinyzero.rollout.vllm import backend

    assert backend.version_problem("0.32.0") is None
    assert backend.version_problem("0.32.1+cpu") is None
    for bad in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(ValueError, match=r"vllm .* outside the tested range >=0\.32\.0,<0\.33.*rollout.name=native"):
            backend.check_version(bad)


def test_sampling_params_from_meta_info():
    cfg = RolloutConfig(n=4, temperature=0.9, response_length=32, seed=3)
    meta = {"pad_token_id": 0, "eos_token_id": [5, 2], "stop_token_ids": [9], "seed": 17, "global_steps": 4}
    p = sampling_params(cfg, meta, num_calls=0, dp_rank=0)
    assert isinstance(p, SamplingParams)
    assert (p.n, p.temperature, p.response_length, p.stop_token_ids, p.pad_token_id) == (4, 0.9, 32, [2, 5, 9], 0)
    # The step's seed replays on a rank whatever the call count; another data-parallel rank gets other noise.
    assert p.seed == sampling_params(cfg, meta, num_calls=5, dp_rank=0).seed
    assert p.seed != sampling_params(cfg, meta, num_calls=0, dp_rank=1).seed
    # Without a step seed every call draws a fresh one.
    no_seed = {k: v for k, v in meta.items() if k != "seed"}
    assert sampling_params(cfg, no_seed, 0, 0).seed != sampling_params(cfg, no_seed, 1, 0).seed
    with pytest.raises(ValueError, match="sampling.top_p"):
        sampling_params(cfg, {**meta, "top_p": 0.0}, 0, 0)
    with pytest.raises(ValueError, match="response_length=0"):
        sampling_params(cfg, {**meta, "response_length": 0}, 0, 0)
