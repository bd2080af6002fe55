"""JudgeConfig: an LLM as judge for open-ended data (`reward.judge`; see docs/judge.md).

    reward.judge.enable=true reward.judge.data_sources=[open_qa] reward.judge.model_path=/models/judge
    reward.judge.enable=true reward.judge.url=http://judge-host:8000 reward.judge.timeout_s=30
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["JudgeConfig"]


@dataclass
class JudgeConfig:
    enable: bool = False
    """Score the samples of `data_sources` with a judge model instead of their rule scorer."""

    mode: Literal["pointwise", "pairwise"] = "pointwise"
    """pointwise: one verdict per response. pairwise: the responses of one prompt (a GRPO group, same
    uid) are compared in every ordered pair, A/B and B/A (n x (n - 1) judge calls per group of n); a
    response scores the fraction of its comparisons it wins (a tie counts half)."""

    data_sources: list[str] = field(default_factory=list)
    """data_source names the judge scores; the others keep their rule scorers in the same batch.
    Empty: the judge scores every data_source."""

    model_path: str | None = None
    """In-process judge: a local HF causal LM folder, loaded frozen on every rank (greedy decoding)."""

    engine: Literal["hf", "native", "vllm"] = "native"
    """In-process judge: what generates its replies. native: tinyzero's own generator (runs wherever torch
    runs); vllm: vLLM in-process (where it is installed; under torchrun); hf: HF `generate`."""

    url: str | None = None
    """Remote judge: the base URL of an OpenAI-compatible server (e.g. `vllm serve`), such as
    http://host:8000 (a trailing /v1 is accepted). Set this or model_path, not both."""

    model: str | None = None
    """Remote judge: the "model" field of each request; None asks the server's /v1/models for its first."""

    api_key_env: str | None = None
    """Remote judge: the name of an environment variable holding the server's API key, sent as
    `Authorization: Bearer <key>` (the key itself stays out of the config and the logs). A name whose
    variable is unset or empty stops the run at start-up. None: no Authorization header."""

    api: Literal["chat", "completions"] = "chat"
    """Remote judge: /v1/chat/completions (the server applies its chat template) or /v1/completions
    (the messages' contents joined as plain text)."""

    template: str = "default"
    """Judge template: a registered name (tinyzero.rewards.judge_prompts) or path/to/file.py:function."""

    parser: str = "default"
    """Score parser: a registered name (tinyzero.rewards.judge_prompts) or path/to/file.py:function."""

    max_new_tokens: int = 128
    """Tokens the judge may write per sample."""

    batch_size: int = 16
    """In-process judge: samples per generate call."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """In-process judge: weight dtype; auto is bfloat16 on GPU and float32 on CPU."""

    pool: Literal["all", "split"] = "all"
    """In-process judge on the native or hf engine: which ranks hold it. "all": every rank loads the judge
    and judges its share of the batch. "split": only the ranks of the second pool of
    pipeline.placement=split (beside the critic and reward model) load it and judge every judged sample
    between them, so its memory stays off the policy ranks; rule-scored samples still spread over every
    rank. A judge larger than one rank's memory belongs behind a server (url)."""

    max_prompt_length: int = 4096
    """In-process judge on the native or vllm engine: the longest judge prompt in tokens (the template with
    the prompt, the response and the reference); a longer one gets no verdict (a reward fault,
    reward.on_error). vLLM's max_model_len is this plus max_new_tokens."""

    gpu_memory_utilization: float = 0.2
    """In-process judge on the vllm engine, on GPU: the fraction of device memory its vLLM may take (weights
    and KV cache); the actor, its rollout engine and training share the rest."""

    concurrency: int = 8
    """Remote judge: requests in flight at once per rank."""

    timeout_s: float = 60.0
    """Remote judge: seconds to wait for one answer; past it the request counts as failed and is retried."""

    retries: int = 3
    """Remote judge: attempts per request on a connection error, a timeout, HTTP 5xx / 408 / 429. A
    request that fails them all is a reward fault (reward.on_error)."""

    def __post_init__(self):
        if isinstance(self.data_sources, str):
            self.data_sources = [self.data_sources]
        self.data_sources = [str(d) for d in self.data_sources]
        for name in ("max_new_tokens", "batch_size", "concurrency", "retries", "max_prompt_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"reward.judge.{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.judge.timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.api_key_env is not None and (not self.api_key_env or "=" in self.api_key_env):
            raise ValueError(f"reward.judge.api_key_env={self.api_key_env!r} must name an environment variable "
                             "(such as JUDGE_API_KEY), not hold the key")
        if self.enable and self.api_key_env is not None and self.url is None:
            warnings.warn(f"reward.judge.api_key_env={self.api_key_env} is ignored: it is sent to a remote judge "
                          "(reward.judge.url), and this judge runs in-process", stacklevel=2)
        if self.engine not in ("hf", "native", "vllm"):
            raise ValueError(f"reward.judge.engine={self.engine!r} is not one of hf, native, vllm")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"reward.judge.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward.judge.url must be an http(s) URL such as http://host:8000, got {self.url!r}")
        if self.enable and (self.model_path is None) == (self.url is None):
            raise ValueError("reward.judge.enable=true needs exactly one of reward.judge.model_path (a local HF "
                             "model, run in-process) or reward.judge.url (an OpenAI-compatible server); got "
                             f"model_path={self.model_path!r}, url={self.url!r}")
        if self.enable:
            from tinyzero.rewards.judge_prompts import registered

            for setting in ("template", "parser"):
                value, table = getattr(self, setting), registered(setting, self.mode == "pairwise")
                if value not in table and not value.rpartition(":")[0].endswith(".py"):
                    raise ValueError(f"reward.judge.{setting}={value!r} is not a registered {self.mode} {setting}; "
                                     f"choose one of {sorted(table)} or give path/to/file.py:function")

    def judges(self, data_source: str) -> bool:
        """Whether the judge scores samples of this data_source."""
        return self.enable and (not self.data_sources or data_source in self.data_sources)
