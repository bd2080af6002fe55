"""The offline tiny model: a byte-level tokenizer and a randomly initialised small Qwen2.

Tests and the CPU demo need a real HF model folder without any download. This module
writes one:

    python -m tinyzero.models.tiny --out /tmp/tiny_model [--seed 0 --hidden_size 64 ...]

Tokenizer: one token per byte (the 256 symbols of the GPT-2 / Qwen byte-level alphabet,
so a space is stored as 'G-dot' and a newline as 'C-dot'), no merges, the same
normalizer / pre-tokenizer / decoder pipeline as Qwen2's tokenizer. Any UTF-8 text
therefore round-trips exactly, whether transformers loads `tokenizer.json` directly or
rebuilds the tokenizer from vocab + merges as its `Qwen2Tokenizer` class does.
Special tokens follow Qwen: `<|endoftext|>` (pad, and the base-model end of text),
`<|im_start|>`, `<|im_end|>` (eos of a chat turn). The chat template is Qwen's ChatML.

Model: `Qwen2ForCausalLM` with hidden 64, 2 layers, 4 query heads, 2 key/value heads
(grouped-query attention is exercised), `tie_word_embeddings=True` like Qwen2.5-0.5B..3B
(so checkpoint / export / weight-sync code paths see the tied lm_head they will meet on
real Qwen2.5 models), max_position_embeddings 2048, fp32 safetensors weights.
`config.vocab_size` equals the tokenizer size (259).
"""

from __future__ import annotations

import argparse
import json
import os

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# Qwen2's pre-tokenizer split (kept identical so a rebuild by `Qwen2Tokenizer` tokenizes the same way).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML as used by Qwen2.5 (without the default system prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_alphabet() -> list[str]:
    """The 256 byte-level symbols (GPT-2 `bytes_to_unicode`), ordered by byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1)
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def build_tokenizer():
    """Return a `tokenizers.Tokenizer`: byte-level, one token per byte, plus Qwen's special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {sym: i for i, sym in enumerate(byte_alphabet())}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _write_tokenizer(out_dir: str) -> dict[str, int]:
    from transformers import PreTrainedTokenizerFast

    raw = build_tokenizer()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out_dir)
    # Name the Qwen2 class (as real Qwen checkpoints do) so AutoTokenizer / vLLM treat it as Qwen2;
    # keep the chat template inside tokenizer_config.json too for older readers.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(
        tokenizer_class="Qwen2Tokenizer",
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        add_prefix_space=False,
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
        model_max_length=32768,
    )
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    # Qwen checkpoints also ship vocab.json + merges.txt; some loaders rebuild from them.
    with open(os.path.join(out_dir, "vocab.json"), "w") as f:
        json.dump({sym: i for i, sym in enumerate(byte_alphabet())}, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    return {t: raw.token_to_id(t) for t in SPECIAL_TOKENS} | {"__size__": raw.get_vocab_size()}


def build_tiny_model(
    out_dir: str,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
) -> str:
    """Write tokenizer + randomly initialised Qwen2ForCausalLM (safetensors) to `out_dir`; return it.

    Deterministic for a given seed: two calls with the same arguments write identical weights.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    os.makedirs(out_dir, exist_ok=True)
    ids = _write_tokenizer(out_dir)
    pad_id, eos_id = ids[PAD_TOKEN], ids[EOS_TOKEN]

    config = Qwen2Config(
        vocab_size=ids["__size__"],
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        use_sliding_window=False,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=0.02,
        torch_dtype="float32",
    )
    config.architectures = ["Qwen2ForCausalLM"]
    gen = torch.Generator().manual_seed(seed)
    # Initialise outside HF's init so the weights depend on the seed only (not on global RNG state).
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.normal_(0.0, config.initializer_range, generator=gen)
    model = model.to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=pad_id,
        eos_token_id=[eos_id, pad_id],
        pad_token_id=pad_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    ).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--num_kv_heads", type=int, default=2)
    parser.add_argument("--intermediate_size", type=int, default=256)
    parser.add_argument("--max_position_embeddings", type=int, default=2048)
    parser.add_argument("--untie_word_embeddings", action="store_true", help="separate lm_head weight")
    args = parser.parse_args(argv)
    out = build_tiny_model(
        args.out,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=not args.untie_word_embeddings,
    )
    print(out)


if __name__ == "__main__":
    main()
