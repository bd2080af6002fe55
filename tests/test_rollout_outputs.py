"""pad_responses (ragged engine results -> padded tensors) against a plain-loop reference.

pad_responses cuts responses through generate.finish_responses, the native engine's cut; the reference
here is the straightforward per-row loop: truncate to `length`, keep up to and including the first
stop token, pad the rest. Exact equality (integer tokens, float32 log-probs copied, not computed).
"""

from __future__ import annotations

import random

import pytest
import torch

from tinyzero.rollout.generate import finish_responses
from tinyzero.rollout.outputs import pad_responses


def reference(token_lists, logprob_lists, length, pad_token_id, stop_token_ids):
    rows = len(token_lists)
    responses = torch.full((rows, length), pad_token_id, dtype=torch.long)
    mask = torch.zeros(rows, length, dtype=torch.long)
    log_probs = torch.zeros(rows, length, dtype=torch.float32)
    for i, (toks, lps) in enumerate(zip(token_lists, logprob_lists)):
        kept = []
        for tok in toks[:length]:
            kept.append(tok)
            if tok in stop_token_ids:
                break
        for j, tok in enumerate(kept):
            responses[i, j], mask[i, j], log_probs[i, j] = tok, 1, lps[j]
    return responses, mask, log_probs


@pytest.mark.parametrize("stop_token_ids", [[], [3], [3, 7]])
def test_pad_responses_matches_plain_loop(stop_token_ids):
    rng = random.Random(0)
    length, pad = 12, 0
    # Ragged rows: empty, shorter than, equal to and longer than `length`, with and without stops.
    token_lists = [[rng.randrange(1, 10) for _ in range(n)] for n in (0, 1, 5, 12, 17, 9, 12, 3)]
    logprob_lists = [[-rng.random() for _ in toks] for toks in token_lists]
    got = pad_responses(token_lists, logprob_lists, length, pad, stop_token_ids)
    want = reference(token_lists, logprob_lists, length, pad, stop_token_ids)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_finish_responses_per_row_lengths_match_one_length():
    tokens = torch.randint(1, 6, (4, 10))
    log_probs = -torch.rand(4, 10)
    stop_ids = torch.tensor([5])
    one = finish_responses(tokens, log_probs, stop_ids, 7, pad_token_id=0)
    per_row = finish_responses(tokens, log_probs, stop_ids, torch.full((4,), 7), pad_token_id=0)
    for a, b in zip(one, per_row):
        assert torch.equal(a, b)


def test_missing_log_probs_name_the_row():
    with pytest.raises(ValueError, match="response 1 keeps 3 tokens but has 1 log-probs"):
        pad_responses([[1, 2], [4, 5, 6]], [[-0.1, -0.2], [-0.3]], 8, 0, [9])
    # Log-probs missing only past the stop token are never used.
    responses, mask, _ = pad_responses([[4, 9, 6]], [[-0.3, -0.4]], 8, 0, [9])
    assert mask.sum() == 2 and responses[0, :2].tolist() == [4, 9]
