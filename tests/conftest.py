"""Shared fixtures: the offline tiny model (built once per session) and the real SmolLM2-135M (cached)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A freshly built offline tiny Qwen2-style model + tokenizer folder."""
    from tinyzero.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("tiny_model")
    build_tiny_model(str(out), seed=0)
    return str(out)


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct as a plain HF folder (fp32), converted once and cached (tests/real_model.py);
    skips with the reason where the package index cannot be reached."""
    from tests.real_model import smollm2_path_or_skip_reason

    path, reason = smollm2_path_or_skip_reason()
    if path is None:
        pytest.skip(reason)
    return path
