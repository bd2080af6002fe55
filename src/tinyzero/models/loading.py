"""Load HF causal LMs, configs and tokenizers from a local folder (Qwen2/2.5, Llama, Mistral, ...).

Nothing is downloaded: `path` must be a local folder holding config.json and safetensors
(or `.bin` files, read by transformers with `torch.load(weights_only=True)`).
`check_model_path` fails with a clear ValueError before any process-group work is done, so a
typo in a path never turns into a distributed hang.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import torch

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp64": torch.float64, "float64": torch.float64,  # CPU reference runs
}


def check_model_path(path: str, need_weights: bool = True) -> str:
    """Return the absolute folder if it holds a loadable HF model, else raise ValueError saying what is missing."""
    if not path:
        raise ValueError("model path is empty: set model.path to a local HF model folder")
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise ValueError(
            f"model path {path!r} does not exist (nothing is downloaded: point model.path at a local folder, "
            "e.g. one written by `python -m tinyzero.models.tiny --out DIR`)"
        )
    if not os.path.isdir(full):
        raise ValueError(f"model path {path!r} is a file; it must be a folder with config.json and weights")
    if not os.path.isfile(os.path.join(full, "config.json")):
        raise ValueError(f"model path {path!r} has no config.json")
    if need_weights and not find_weight_files(full):
        raise ValueError(
            f"model path {path!r} holds no weights (*.safetensors, model.safetensors.index.json or "
            "pytorch_model*.bin)"
        )
    return full


def find_weight_files(folder: str) -> list[str]:
    """Weight files in `folder`, safetensors preferred."""
    st = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if st:
        return st
    return sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))


def check_weight_files(folder: str) -> None:
    """Every safetensors file's header must parse: else one ValueError naming the file."""
    from safetensors import safe_open

    check_json_file(os.path.join(folder, "model.safetensors.index.json"), "the weight index")
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        try:
            with safe_open(path, framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - SafetensorError and OSError alike mean a bad file
            raise ValueError(f"{path}: not a readable safetensors file ({e}); the file is corrupt or truncated, "
                             "copy or export the model again") from None


def check_tokenizer_path(path: str) -> str:
    """Return the absolute folder if it holds tokenizer files, else raise ValueError."""
    if not path:
        raise ValueError("tokenizer path is empty: set model.path (or model.tokenizer_path)")
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(full):
        raise ValueError(f"tokenizer path {path!r} is not an existing folder")
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(full, n)) for n in names):
        raise ValueError(f"tokenizer path {path!r} has none of {names}")
    return full


def pick_dtype(device: torch.device | str, requested: str | torch.dtype = "auto") -> torch.dtype:
    """Dtype from a name; "auto" is bf16 on a GPU that supports it, fp32 elsewhere."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested in _DTYPES:
        return _DTYPES[requested]
    if requested != "auto":
        raise ValueError(f"unknown dtype {requested!r}; use one of auto, {', '.join(_DTYPES)}")
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def flash_attn_available() -> bool:
    """True when the flash-attn package is importable."""
    return importlib.util.find_spec("flash_attn") is not None


def pick_attn_implementation(device: torch.device | str, requested: str | None = "auto",
                             compute_dtype: torch.dtype | None = None) -> str:
    """HF attn_implementation: flash_attention_2 on GPU when installed and the compute dtype is bf16 / fp16
    (flash-attn has no fp32 kernel), else sdpa (CPU and GPU). `compute_dtype` None: not known, assumed 16-bit."""
    device = torch.device(device)
    half = compute_dtype is None or compute_dtype in (torch.bfloat16, torch.float16)
    if requested in (None, "", "auto"):
        if device.type == "cuda" and flash_attn_available() and half:
            return "flash_attention_2"
        return "sdpa"
    if requested == "flash_attention_2" and (device.type != "cuda" or not flash_attn_available()):
        raise ValueError(
            "attn_implementation='flash_attention_2' needs a CUDA device and the flash-attn package; "
            "use 'sdpa' or 'auto'"
        )
    return requested


def check_json_file(path: str, what: str) -> None:
    """A JSON file that exists must parse: else one ValueError naming the file, line and column."""
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: {what} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); the "
                         "file is corrupt or truncated, copy or export it again") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read {what} ({e})") from None


def _load_error(folder: str, what: str, e: Exception) -> ValueError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ValueError(f"{folder}: cannot load the {what} ({type(e).__name__}: {first}); the files are corrupt, "
                      "incomplete or not an HF model folder")


def load_tokenizer(path: str, trust_remote_code: bool = False, padding_side: str = "left"):
    """AutoTokenizer from a local folder; a missing pad token falls back to eos (with a warning)."""
    from transformers import AutoTokenizer

    full = check_tokenizer_path(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"):
        check_json_file(os.path.join(full, name), name)
    try:
        tok = AutoTokenizer.from_pretrained(full, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own types; the folder is what to fix
        raise _load_error(full, "tokenizer", e) from e
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {path!r} has neither a pad nor an eos token")
        import warnings

        warnings.warn(f"tokenizer at {path!r} has no pad token; using eos {tok.eos_token!r} as pad", stacklevel=2)
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def load_hf_config(path: str, trust_remote_code: bool = False, override_config: dict | None = None):
    """AutoConfig from a local folder, with `override_config` entries applied."""
    from transformers import AutoConfig

    full = check_model_path(path, need_weights=False)
    check_json_file(os.path.join(full, "config.json"), "the model config")
    try:
        cfg = AutoConfig.from_pretrained(full, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _load_error(os.path.join(full, "config.json"), "model config", e) from e
    for key, value in (override_config or {}).items():
        setattr(cfg, key, value)
    return cfg


def _auto_class(kind: str):
    import transformers

    classes = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "token_classification": transformers.AutoModelForTokenClassification,
        "sequence_classification": transformers.AutoModelForSequenceClassification,
    }
    if kind not in classes:
        raise ValueError(f"unknown model kind {kind!r}; use one of {sorted(classes)}")
    return classes[kind]


def load_model(
    path: str,
    kind: str = "causal_lm",
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "auto",
    trust_remote_code: bool = False,
    override_config: dict | None = None,
    config_kwargs: dict | None = None,
    compute_dtype: torch.dtype | None = None,
):
    """Instantiate a HF model of `kind` from a local folder.

    `compute_dtype`: the dtype forward runs in when it differs from the weights' (FSDP2 mixed precision,
    tinyzero.models.precision); it decides whether "auto" attention may pick flash-attn. None: the weights'.

    device="meta" builds the architecture without reading any weights (for FSDP meta init);
    otherwise the weights are loaded on CPU and moved to `device`. `config_kwargs` are applied to
    the config after `override_config` (e.g. num_labels=1 for a value head).
    """
    full = check_model_path(path, need_weights=torch.device(device).type != "meta")
    device = torch.device(device)
    # A meta model is materialized later on the accelerator if there is one: pick dtype/attn for that.
    if device.type == "meta":
        compute_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        compute_device = device
    torch_dtype = pick_dtype(compute_device, dtype)
    compute_dtype = torch_dtype if compute_dtype is None else compute_dtype
    attn = pick_attn_implementation(compute_device, attn_implementation, compute_dtype)
    cfg = load_hf_config(full, trust_remote_code=trust_remote_code, override_config=override_config)
    for key, value in (config_kwargs or {}).items():
        setattr(cfg, key, value)
    auto = _auto_class(kind)
    if device.type == "meta":
        with torch.device("meta"):
            model = auto.from_config(cfg, dtype=torch_dtype, attn_implementation=attn,
                                     trust_remote_code=trust_remote_code)
        _attach_generation_config(model, full)
        return model
    check_weight_files(full)
    try:
        model = auto.from_pretrained(
            full, config=cfg, dtype=torch_dtype, attn_implementation=attn, trust_remote_code=trust_remote_code,
            local_files_only=True,
        )
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise _load_error(full, "model weights", e) from e
    return model.to(device)


def _attach_generation_config(model, folder: str) -> None:
    """Give a config-built model the folder's generation_config.json (eos ids etc.), as from_pretrained does."""
    if not os.path.isfile(os.path.join(folder, "generation_config.json")) or not hasattr(model, "generation_config"):
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)


def load_causal_lm(
    path: str,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "auto",
    trust_remote_code: bool = False,
    override_config: dict | None = None,
):
    """AutoModelForCausalLM from a local folder (see `load_model`)."""
    return load_model(path, "causal_lm", dtype=dtype, device=device, attn_implementation=attn_implementation,
                      trust_remote_code=trust_remote_code, override_config=override_config)
