"""Shared fixtures: the offline tiny model is built once per session."""

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
