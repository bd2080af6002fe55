"""Triton kernels with torch reference paths: log-probs / entropy, advantages."""
