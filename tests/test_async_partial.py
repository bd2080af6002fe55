"""Partial rollouts (pipeline.partial_rollout): weights that land between decoding segments.

In process, native engine on a tiny random Qwen2: a generation told that version 1 is coming takes
it after its first segment and continues the unfinished rows under it; every token records the
version that sampled it, and its recorded rollout log-prob equals a float64 recomputation under that
version (fp32 engine, tolerance 1e-4). Through train.py (2 CPU ranks, 1 trainer + 1 rollout, K=1):
a run with partial rollouts on trains with finite metrics, staleness never above K, token versions
never older than the sample's, and the engine holding the trainer's weights after every update.
Budget: about 45 s on an idle 2-core machine.
"""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

from tests.test_async import ENV, ROOT, _args, _cmd, _config, setup  # noqa: F401 - setup is a fixture
from tests.test_full_params import _model  # a tiny random Qwen2 (vocab 97, eos 1, pad 0)
from tinyzero.trainer.loggers import read_metrics


class LocalSource:
    """The weights of the next version, handed over in process as soon as they are asked for."""

    def __init__(self, state: dict):
        self.state = state
        self.received = 0

    def arrived(self, version: int) -> bool:
        return True

    def receive(self, version: int):
        self.received += 1
        return iter(self.state.items())


def _prompts(meta: dict):
    from tinyzero.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 97, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding on one prompt
    ids = torch.where(mask.bool(), ids, 0)
    pos = torch.clamp(torch.cumsum(mask, dim=-1) - 1, min=0)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               meta_info={"eos_token_id": 1, "pad_token_id": 0, "seed": 123, **meta})


def test_tokens_after_a_mid_generation_update_carry_the_new_version_and_its_log_probs():
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.rollout.native import NativeRollout
    from tinyzero.rollout.partial import PartialRollout

    old, new = _model(0), _model(1)
    engine = NativeRollout(RolloutConfig(response_length=10, n=2, dtype="float32", temperature=0.9), old.config, "cpu")
    engine.update_weights(old.state_dict().items())
    source = LocalSource(new.state_dict())
    partial = PartialRollout(engine, chunk=3, source=source)
    out = partial.generate_sequences(_prompts({"rollout_weight_version": 4, "partial_rollout_version": 5}))
    assert source.received == 1 and partial.held_version == 5

    mask = out.batch["response_mask"].bool()                    # (rows, R)
    versions = out.batch["rollout_token_versions"]              # (rows, R)
    assert versions.shape == mask.shape and versions.dtype == torch.int64
    assert bool((versions[~mask] == -1).all())
    assert bool((versions[:, :3][mask[:, :3]] == 4).all())      # the first segment: the old weights
    assert bool((versions[:, 3:][mask[:, 3:]] == 5).all())      # every later token: the new ones
    assert any(set(versions[i][mask[i]].tolist()) == {4, 5} for i in range(len(mask)))

    # Recompute each token's log-prob under the version that sampled it (float64, HF forward).
    temperature = out.meta_info["temperature"]
    models = {4: old.double(), 5: new.double()}
    P = out.batch["prompts"].shape[1]
    checked = wrong_version_gap = 0
    for i in range(len(mask)):
        prompt = out.batch["prompts"][i][out.batch["attention_mask"][i, :P].bool()]
        response = out.batch["responses"][i][mask[i]]
        seq = torch.cat([prompt, response])[None]
        with torch.no_grad():
            lps = {v: torch.log_softmax(m(seq).logits[0] / temperature, dim=-1) for v, m in models.items()}
        for t, token in enumerate(response.tolist()):
            v = int(versions[i, t])
            ref = float(lps[v][len(prompt) + t - 1, token])
            assert float(out.batch["rollout_log_probs"][i, t]) == pytest.approx(ref, abs=1e-4), (i, t, v)
            wrong_version_gap = max(wrong_version_gap, abs(float(lps[9 - v][len(prompt) + t - 1, token]) - ref))
            checked += 1
    assert checked > 12 and wrong_version_gap > 1e-2  # the two versions really differ


def test_without_an_incoming_version_the_generation_is_the_engines():
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.rollout.native import NativeRollout
    from tinyzero.rollout.partial import PartialRollout

    old = _model(0)
    engine = NativeRollout(RolloutConfig(response_length=8, n=2, dtype="float32"), old.config, "cpu")
    engine.update_weights(old.state_dict().items())
    plain = engine.generate_sequences(_prompts({}))
    engine.num_calls = 0  # the same call seed again
    out = PartialRollout(engine, chunk=3, source=LocalSource({})).generate_sequences(
        _prompts({"rollout_weight_version": 2}))
    for key in plain.batch.keys():
        assert torch.equal(out.batch[key], plain.batch[key]), key
    mask = out.batch["response_mask"].bool()
    assert bool((out.batch["rollout_token_versions"][mask] == 2).all())


def test_partial_rollout_config_errors_name_the_fix():
    from tinyzero.config import ConfigError, PipelineConfig

    with pytest.raises(ConfigError, match="partial_rollout=true.*max_staleness=1"):
        _config(pipeline__partial_rollout=True)
    with pytest.raises(ConfigError, match="partial_rollout_chunk must be >= 1"):
        PipelineConfig(partial_rollout_chunk=0)
    _config(pipeline__partial_rollout=True, pipeline__max_staleness=1, rollout__use_rollout_log_probs=True)


@pytest.mark.slow
def test_partial_rollouts_through_train_py(setup):  # noqa: F811 - the fixture
    root, model = setup
    # Long responses in 2-token segments: the update usually lands mid-generation (timing decides where).
    args = _args(root, model, "partial", "--pipeline.partial_rollout=true", "--pipeline.partial_rollout_chunk=2",
                 "--data.max_response_length=16", "--trainer.total_training_steps=3", "--trainer.save_freq=-1",
                 "--trainer.val_before_train=false", "--trainer.export_hf=false")
    out = subprocess.run(_cmd(args), env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = read_metrics(str(root / "partial"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "async/partial_rollout/mixed_frac"):
            assert math.isfinite(r[key]), (r["step"], key, r[key])
        assert r["async/staleness/max"] <= 1
        assert r["async/weight_version"] == r["step"]
        assert r["async/weight_checksum/rollout"] == pytest.approx(r["async/weight_checksum/trainer"], rel=1e-9)
        assert 0.0 <= r["async/partial_rollout/mixed_frac"] <= 1.0
    # The warm-up batch is generated before any update: one version, on-policy.
    assert rows[0]["async/staleness/max"] == 0 and rows[0]["async/partial_rollout/mixed_frac"] == 0.0
    assert rows[0]["training/rollout_probs_diff_max"] < 1e-5
