"""Triton kernels with torch reference paths: log-probs / entropy, advantages.

Public functions pick the Triton kernels for CUDA tensors and the (vectorised) torch paths
everywhere else; each also takes `backend="auto" | "torch" | "triton"`.

    log_probs_from_logits(logits, labels, temperature=1.0, return_entropy=False)
    linear_log_probs(hidden, weight, labels, temperature=1.0, return_entropy=False)
    vocab_parallel_log_probs(hidden, weight_shard, labels, vocab_start, tp_group, ...)   lm_head sharded by vocab
    entropy_from_logits(logits, temperature=1.0)
    reverse_linear_scan(a, b)                  x[t] = b[t] + a[t] * x[t+1]
    gae_advantage_return(rewards, values, mask, gamma, lam)   un-whitened GAE + returns
    discounted_returns(rewards, mask, gamma)   REINFORCE++ returns
    group_ids(index) / group_mean_std(scores, ids, num_groups)   per-uid statistics

Triton is imported only when a Triton kernel first runs. To run the kernels on CPU tensors
(tests), start the process with TRITON_INTERPRET=1: Triton reads it when functions are
decorated, its own standard library included, so it must be set before `import triton`.
"""

from ._backend import HAS_TRITON, use_triton
from .group_stats import group_ids, group_mean_std, group_stats
from .linear_logprobs import linear_log_probs
from .logprobs import entropy_from_logits, log_probs_from_logits
from .scan import discounted_returns, gae_advantage_return, reverse_linear_scan
from .vocab_parallel import vocab_parallel_log_probs

__all__ = [
    "HAS_TRITON",
    "discounted_returns",
    "entropy_from_logits",
    "gae_advantage_return",
    "group_ids",
    "group_mean_std",
    "group_stats",
    "linear_log_probs",
    "log_probs_from_logits",
    "reverse_linear_scan",
    "use_triton",
    "vocab_parallel_log_probs",
]
