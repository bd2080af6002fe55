"""Value (critic) and reward models: an LM backbone with a scalar head.

`load_value_model(path)` builds `AutoModelForTokenClassification(num_labels=1)` from a causal
LM folder (Qwen2, Llama, Mistral all have one): the backbone weights come from the checkpoint,
`score` (hidden -> 1) is new unless the folder already holds a trained critic. Output
`.logits` has shape (batch, seq, 1); the critic's value for response token t is read at the
same position convention as log-probs (see the workers).

`load_reward_model(path)` builds `AutoModelForSequenceClassification(num_labels=1)`: one
scalar per sequence, read at the rightmost non-pad token.

A new head is initialised from a fixed-seed generator (normal, std = initializer_range, zero
bias), so every rank that builds the model independently gets the same head.
"""

from __future__ import annotations

import json
import os
import warnings

import torch

from tinyzero.models.loading import check_model_path, find_weight_files, load_model

HEAD_NAME = "score"


def checkpoint_has_head(path: str, head_name: str = HEAD_NAME) -> bool:
    """True if the weights in `path` contain a `<head_name>.` tensor (a trained critic / reward model)."""
    folder = check_model_path(path)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            keys = json.load(f)["weight_map"].keys()
        return any(k.startswith(head_name + ".") for k in keys)
    files = [f for f in find_weight_files(folder) if f.endswith(".safetensors")]
    if not files:
        return False
    from safetensors import safe_open

    for fname in files:
        with safe_open(fname, framework="pt") as f:
            if any(k.startswith(head_name + ".") for k in f.keys()):
                return True
    return False


@torch.no_grad()
def init_scalar_head(head: torch.nn.Linear, std: float, seed: int = 0) -> None:
    """Deterministic init of a (hidden -> 1) head: normal(0, std) weight from a seeded generator, zero bias."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(head.weight.shape, generator=gen, dtype=torch.float32) * std
    head.weight.copy_(w.to(head.weight.dtype))
    if head.bias is not None:
        head.bias.zero_()


def _load_with_head(path, kind, dtype, device, attn_implementation, trust_remote_code, override_config,
                    head_seed, what):
    on_meta = torch.device(device).type == "meta"
    config_kwargs = {"num_labels": 1, "classifier_dropout": 0.0}
    model = load_model(path, kind, dtype=dtype, device=device, attn_implementation=attn_implementation,
                       trust_remote_code=trust_remote_code, override_config=override_config,
                       config_kwargs=config_kwargs)
    head = getattr(model, HEAD_NAME, None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear `{HEAD_NAME}` head; cannot use it as a {what}")
    if not on_meta and not checkpoint_has_head(path):
        if kind == "sequence_classification":
            warnings.warn(f"{path!r} has no trained `{HEAD_NAME}` head: the {what} starts untrained", stacklevel=3)
        std = float(getattr(model.config, "initializer_range", 0.02))
        init_scalar_head(head, std, seed=head_seed)
    return model


def load_value_model(
    path: str,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "auto",
    trust_remote_code: bool = False,
    override_config: dict | None = None,
    head_seed: int = 0,
):
    """Critic: token-classification model with one label, initialised from a causal LM (or critic) folder."""
    return _load_with_head(path, "token_classification", dtype, device, attn_implementation, trust_remote_code,
                           override_config, head_seed, "value model")


def load_reward_model(
    path: str,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "auto",
    trust_remote_code: bool = False,
    override_config: dict | None = None,
    head_seed: int = 0,
):
    """Reward model: sequence-classification model with one label (score at the last non-pad token)."""
    return _load_with_head(path, "sequence_classification", dtype, device, attn_implementation,
                           trust_remote_code, override_config, head_seed, "reward model")
