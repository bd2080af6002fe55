"""Model forward passes used by the workers: response log-probs, values, reward scores.

Log-probs never build the [tokens, vocab] logits: the backbone's final hidden states go
with the lm_head weight into `tinyzero.kernels.linear_log_probs`. On an FSDP2 model that
weight is only whole inside a forward, so the computation is attached to the model as a
method (`token_log_probs`) that FSDP runs with its forward hooks
(`register_fsdp_forward_method`): parameters are gathered before it, resharded after, and
gradients reduce-scattered in backward as for `forward`.

Convention: for responses of length R appended to the prompt, the log-prob of response
token t comes from the hidden state at input position (P + t - 1), i.e. the slice
[-R-1:-1] of the sequence; logits are divided by the temperature before the softmax.

`packing` ("none", "remove_padding", "shared_prefix"; see tinyzero.workers.packing) runs the
same computations on packed rows: the model sees a 4-D mask, and the predicting hidden states
are gathered by index instead of sliced.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from tinyzero.workers.batching import trim_padding
from tinyzero.workers.packing import DENSE_ROW_TOKENS, model_mask, pack


def _backbone(model: nn.Module) -> nn.Module:
    prefix = getattr(model, "base_model_prefix", "model")
    backbone = getattr(model, prefix, None)
    if backbone is None:
        raise ValueError(f"{type(model).__name__} has no backbone attribute {prefix!r}")
    return backbone


def _attention_kwargs(model: nn.Module, packed) -> dict:
    """Extra backbone arguments of a packed forward: the segment blocks for packed SDPA."""
    if packed is None or packed.blocks is None:
        return {}
    return {"attention_blocks": packed.blocks}


def _token_log_probs(self, input_ids, attention_mask, position_ids, responses, temperature=1.0,
                     return_entropy=False, packed=None):
    """Log-probs (and entropy) of `responses`, both (batch, R) fp32.

    Unpacked, `responses` are the last columns of `input_ids`. With `packed` (a
    tinyzero.workers.packing.Packed whose tensors are the inputs), the hidden states at
    `packed.hidden_index` predict the valid response tokens; padding positions get 0.
    """
    from tinyzero.kernels import linear_log_probs

    out = _backbone(self)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False, **_attention_kwargs(self, packed))
    weight = self.get_output_embeddings().weight  # (vocab, hidden)
    if packed is None:
        r = responses.shape[1]
        hidden = out.last_hidden_state[:, -r - 1:-1]  # (batch, R, hidden)
        labels = responses
    else:
        states = out.last_hidden_state
        hidden = states.reshape(-1, states.shape[-1]).index_select(0, packed.hidden_index)  # (valid, hidden)
        labels = responses[packed.valid]  # (valid,)
    out = linear_log_probs(hidden, weight, labels, temperature=temperature, return_entropy=return_entropy)
    out = out if return_entropy else (out,)
    # Fresh tensors, not views: FSDP hooks the outputs of a forward method for backward.
    out = tuple(t.clone() if packed is None else packed.scatter(t) for t in out)
    return out if return_entropy else out[0]


def attach_log_prob_method(model: nn.Module) -> nn.Module:
    """Give `model` a `token_log_probs(...)` method that FSDP2 treats like forward (under Ulysses when
    the model has an `sp_group`: tinyzero.models.ulysses)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if getattr(model, "sp_group", None) is not None:
        from tinyzero.models.ulysses import attach_sp_log_prob_method

        return attach_sp_log_prob_method(model, model.sp_group)
    if model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head); a causal LM is needed")
    model.token_log_probs = types.MethodType(_token_log_probs, model)
    register_fsdp_forward_method(model, "token_log_probs")
    return model


def _token_scores(self, input_ids, attention_mask, position_ids):
    """Scalar head output at every position, (batch, seq) fp32 (sequence-classification models)."""
    out = _backbone(self)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)
    return self.score(out.last_hidden_state)[..., 0].float()


def attach_score_method(model: nn.Module) -> nn.Module:
    """Give a reward model a `token_scores(...)` method that FSDP2 treats like forward.

    HF's sequence-classification forward picks the last non-pad token by the pad id, which
    is wrong when pad == eos; the workers pick the position from the attention mask instead.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    if not isinstance(getattr(model, "score", None), nn.Module):
        raise ValueError(f"{type(model).__name__} has no `score` head; a sequence-classification model is needed")
    model.token_scores = types.MethodType(_token_scores, model)
    register_fsdp_forward_method(model, "token_scores")
    return model


def pack_batch(model: nn.Module, batch, packing: str):
    """(Packed, model-ready 4-D mask) of a micro-batch."""
    # An L x L mask bounds the row length (flex's BlockMask does not; packed SDPA may fall back to the mask).
    dense = getattr(model.config, "_attn_implementation", "sdpa") != "flex_attention"
    packed = pack(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                  batch["responses"].shape[1], share_prefix=packing == "shared_prefix",
                  max_unit_tokens=DENSE_ROW_TOKENS if dense else None)
    dtype = model.get_input_embeddings().weight.dtype
    return packed, model_mask(packed, model, dtype)


def response_log_probs(model: nn.Module, batch, temperature: float, return_entropy: bool, packing: str = "none"):
    """(log_probs, entropy or None), each (batch, R) fp32, for one micro-batch's tensors.

    Columns that are padding in every row are cut first; the response positions cut on
    the right get log-prob 0 and entropy 0 (they are masked everywhere downstream). Packed,
    every padding position of the responses gets 0.
    """
    responses = batch["responses"]
    if packing != "none":
        packed, mask = pack_batch(model, batch, packing)
        out = model.token_log_probs(packed.input_ids, mask, packed.position_ids, responses, temperature,
                                    return_entropy, packed)
        return out if return_entropy else (out, None)
    r = responses.shape[1]
    ids, mask, pos, kept = trim_padding(batch["input_ids"], batch["attention_mask"], batch["position_ids"], r)
    out = model.token_log_probs(ids, mask, pos, responses[:, :kept], temperature, return_entropy)
    log_probs, entropy = out if return_entropy else (out, None)
    if kept < r:
        log_probs = nn.functional.pad(log_probs, (0, r - kept))
        entropy = nn.functional.pad(entropy, (0, r - kept)) if entropy is not None else None
    return log_probs, entropy


def _head_outputs(model: nn.Module, input_ids, attention_mask, position_ids, packed=None) -> torch.Tensor:
    """A scalar-head model's (rows, L, 1) outputs; gathered over the sequence under Ulysses."""
    group = getattr(model, "sp_group", None)
    if group is not None:
        from tinyzero.models.ulysses import sp_model_forward

        return sp_model_forward(model, input_ids, attention_mask, position_ids, group)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                **_attention_kwargs(model, packed))
    return out.logits if hasattr(out, "logits") else out


def response_values(model: nn.Module, batch, packing: str = "none") -> torch.Tensor:
    """Value predictions (batch, R) fp32 of a token-level scalar-head model at response positions."""
    responses = batch["responses"]
    if packing != "none":
        packed, mask = pack_batch(model, batch, packing)
        logits = _head_outputs(model, packed.input_ids, mask, packed.position_ids, packed)  # (rows, L, 1)
        return packed.scatter(logits.reshape(-1).index_select(0, packed.hidden_index).float())
    r = responses.shape[1]
    ids, mask, pos, kept = trim_padding(batch["input_ids"], batch["attention_mask"], batch["position_ids"], r)
    logits = _head_outputs(model, ids, mask, pos)
    values = logits[:, -kept - 1:-1].squeeze(-1).float()  # (batch, kept)
    if kept < r:
        values = nn.functional.pad(values, (0, r - kept))
    return values
