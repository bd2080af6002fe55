"""LLM as judge: a language model reads a judge template (prompt, response, reference answer) and its
reply is parsed into a score in [0, 1] (see docs/judge.md).

    judge = Judge(JudgeConfig(enable=True, url="http://judge:8000"))
    results = judge.score(prompts, responses, references)   # one RewardManager result dict per sample

Backends behind one `JudgeBackend` protocol (`generate(conversations) -> replies`):
  EngineJudgeBackend  a frozen model on tinyzero's native or vLLM rollout engine on this rank
                      (reward.judge.engine=native, the default, or vllm; tinyzero.rewards.judge_engine),
                      prompts and replies as HFJudgeBackend's.
  HFJudgeBackend      a frozen HF causal LM on this rank (reward.judge.engine=hf): chat template applied by
                      its tokenizer, left padding, greedy decoding, reward.judge.batch_size samples per
                      generate call.
  RemoteJudgeBackend  an OpenAI-compatible server (/v1/chat/completions or /v1/completions) through the
                      remote rollout's HTTP client (tinyzero.runtime.http): temperature 0,
                      reward.judge.concurrency requests in flight, reward.judge.timeout_s per request,
                      reward.judge.retries attempts on transient failures, an API key from the
                      environment variable reward.judge.api_key_env names (Authorization: Bearer).
A reply the parser cannot read, or a request that fails every attempt, gives the sample an error result
(score 0) that the RewardManager handles under reward.on_error like any reward fault.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from tinyzero.rewards.judge_config import JudgeConfig
from tinyzero.rewards.judge_prompts import JudgeParseError, get_judge_parser, get_judge_template
from tinyzero.runtime.http import RemoteRolloutError, Transient, http_json

__all__ = ["HFJudgeBackend", "Judge", "JudgeBackend", "JudgeError", "RemoteJudgeBackend", "build_backend",
           "reference_text"]

BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 4.0


class JudgeError(RuntimeError):
    """The judge gave no reply for a sample (a server that failed every attempt, timed out, or refused)."""

    def __init__(self, message: str, timeout: bool = False):
        super().__init__(message)
        self.timeout = timeout


class JudgeBackend(Protocol):
    name: str
    """How errors name the judge (its path or URL)."""

    def generate(self, conversations: list[list[dict]]) -> list[str | JudgeError]:
        """One reply per conversation (greedy), or the JudgeError of a conversation that got none."""
        ...


# ---------------------------------------------------------------------------------------------- in-process
_HF_MODELS: dict[tuple, tuple] = {}
"""(path, dtype, device) -> (tokenizer, model): the train and validation reward managers share one copy."""


def _load_hf(path: str, dtype: str, device: torch.device):
    key = (path, dtype, str(device))
    if key not in _HF_MODELS:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype == "auto":
            dtype = "bfloat16" if device.type == "cuda" else "float32"
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        except (OSError, ValueError) as e:
            raise ValueError(f"reward.judge.model_path={path!r} could not be loaded as an HF causal LM: {e}"[:600]
                             ) from e
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.to(device).eval().requires_grad_(False)
        _HF_MODELS[key] = (tokenizer, model)
    return _HF_MODELS[key]


def default_device() -> torch.device:
    """Where an in-process judge runs unless told: this rank's current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def render_conversation(tokenizer, messages: list[dict]) -> tuple[str, bool]:
    """(text, add_special_tokens): the chat template with a generation prompt where the tokenizer has one
    (its special tokens are in the text), else the contents joined by blank lines."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), False
    return "\n\n".join(m["content"] for m in messages), True


class HFJudgeBackend:
    """A frozen HF causal LM on this rank, greedy, batched with left padding."""

    def __init__(self, config: JudgeConfig, device: torch.device | None = None):
        device = device if device is not None else default_device()
        self.config, self.device, self.name = config, device, f"the in-process judge {config.model_path}"
        self.tokenizer, self.model = _load_hf(config.model_path, config.dtype, device)
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        self.eos_token_id = eos if eos is not None else self.tokenizer.eos_token_id

    @torch.no_grad()
    def generate(self, conversations: list[list[dict]]) -> list[str | JudgeError]:
        replies: list[str | JudgeError] = []
        size = self.config.batch_size
        for start in range(0, len(conversations), size):
            rendered = [render_conversation(self.tokenizer, c) for c in conversations[start:start + size]]
            enc = self.tokenizer([t for t, _ in rendered], return_tensors="pt", padding=True,
                                 add_special_tokens=rendered[0][1]).to(self.device)
            out = self.model.generate(**enc, do_sample=False, max_new_tokens=self.config.max_new_tokens,
                                      pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.eos_token_id,
                                      temperature=None, top_p=None, top_k=None)  # (batch, prompt + new)
            new = out[:, enc["input_ids"].shape[1]:]
            replies.extend(self.tokenizer.batch_decode(new, skip_special_tokens=True))
        return replies


# ---------------------------------------------------------------------------------------------- remote
def api_key_headers(api_key_env: str | None) -> dict[str, str]:
    """{"Authorization": "Bearer <key>"} from the environment variable reward.judge.api_key_env names ({} for
    None); ValueError naming the variable when it is unset or empty. The key appears in no message."""
    if api_key_env is None:
        return {}
    key = os.environ.get(api_key_env, "").strip()
    if not key:
        raise ValueError(f"reward.judge.api_key_env={api_key_env}: the environment variable {api_key_env} is "
                         f"{'empty' if api_key_env in os.environ else 'not set'}; export the judge server's API key "
                         "in it on every rank, or unset reward.judge.api_key_env")
    return {"Authorization": f"Bearer {key}"}


class RemoteJudgeBackend:
    """An OpenAI-compatible server; per-request timeout and retries, bounded concurrency."""

    def __init__(self, config: JudgeConfig):
        base = config.url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        self.config, self.name = config, f"the judge server {self.base}"
        self._model = config.model
        self._headers = api_key_headers(config.api_key_env)

    def _call(self, path: str, body: dict | None) -> dict | None:
        cfg, url, last = self.config, self.base + path, None
        for attempt in range(cfg.retries):
            try:
                return http_json(url, body, timeout=cfg.timeout_s, headers=self._headers)
            except Transient as e:
                last = e
                if attempt + 1 < cfg.retries:
                    time.sleep(min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** attempt))
            except RemoteRolloutError as e:  # an error answer that a retry will not change
                raise JudgeError(f"{self.name} refused the request: {e}"[:600]) from e
        timed_out = "timed out" in str(last).lower() or "timeout" in type(last.__cause__).__name__.lower()
        raise JudgeError(f"{self.name} gave no answer after {cfg.retries} attempt(s) of up to reward.judge.timeout_s="
                         f"{cfg.timeout_s:g} s (reward.judge.retries={cfg.retries}): {last}"[:600], timeout=timed_out)

    def model(self) -> str:
        """The request's "model": reward.judge.model, else the first model the server lists."""
        if self._model is None:
            listing = self._call("/v1/models", None) or {}
            models = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
            if not models or not models[0]:
                raise JudgeError(f"{self.name} lists no model at /v1/models; set reward.judge.model")
            self._model = str(models[0])
        return self._model

    def _ask(self, messages: list[dict]) -> str:
        cfg = self.config
        body = {"model": self.model(), "max_tokens": cfg.max_new_tokens, "temperature": 0.0, "n": 1}
        if cfg.api == "chat":
            reply = self._call("/v1/chat/completions", {**body, "messages": messages})
        else:
            reply = self._call("/v1/completions", {**body, "prompt": "\n\n".join(m["content"] for m in messages)})
        try:
            choice = (reply or {})["choices"][0]
            text = choice["message"]["content"] if cfg.api == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError) as e:
            raise JudgeError(f"{self.name} answered without a reply text: {reply!r}"[:600]) from e
        return text if isinstance(text, str) else ""

    def generate(self, conversations: list[list[dict]]) -> list[str | JudgeError]:
        def one(messages):
            try:
                return self._ask(messages)
            except JudgeError as e:
                return e

        if not conversations:
            return []
        self.model()  # one /v1/models probe before the requests fan out
        with ThreadPoolExecutor(max_workers=min(self.config.concurrency, len(conversations))) as pool:
            return list(pool.map(one, conversations))


# ---------------------------------------------------------------------------------------------- the judge
class AbsentJudgeBackend:
    """The judge seen from a rank outside its pool (reward.judge.pool=split): it holds no model and is given
    no sample to judge (the RewardManager sends judged samples to the judge's ranks only)."""

    def __init__(self, config: JudgeConfig):
        self.name = f"the in-process judge {config.model_path} ({config.engine} engine)"

    def generate(self, conversations: list) -> list:
        if conversations:
            raise RuntimeError(f"{self.name} is not loaded on this rank (reward.judge.pool=split); it was asked to "
                               f"judge {len(conversations)} samples")
        return []


def build_backend(config: JudgeConfig) -> JudgeBackend:
    """The backend the settings name: the server at reward.judge.url, else reward.judge.model_path on
    reward.judge.engine (HF generate, or a rollout engine: tinyzero.rewards.judge_engine)."""
    if config.url:
        return RemoteJudgeBackend(config)
    if config.engine == "hf":
        return HFJudgeBackend(config)
    from tinyzero.rewards.judge_engine import EngineJudgeBackend

    return EngineJudgeBackend(config)


def reference_text(ground_truth) -> str | None:
    """A row's ground truth as the reference answer shown to the judge (None when it has none)."""
    if ground_truth is None or (isinstance(ground_truth, str) and not ground_truth.strip()):
        return None
    return ground_truth if isinstance(ground_truth, str) else str(ground_truth)


class Judge:
    """Template -> backend -> parser: one RewardManager result dict per sample (pointwise), or one
    preference per pair of responses (pairwise, see tinyzero.rewards.judge_pairwise)."""

    def __init__(self, config: JudgeConfig, backend: JudgeBackend | None = None):
        self.config = config
        self.template = get_judge_template(config.template, pairwise=config.mode == "pairwise")
        self.parser = get_judge_parser(config.parser, pairwise=config.mode == "pairwise")
        self.backend = backend if backend is not None else build_backend(config)
        self.name = self.backend.name

    def score(self, prompts: list[str], responses: list[str], ground_truths: list) -> list[dict]:
        """Results as the RewardManager keeps them, plus "judge": "ok" / "parse_error" / "failed"."""
        conversations = [self.template(p, r, reference_text(g)) for p, r, g in zip(prompts, responses, ground_truths)]
        return [self._result(reply) for reply in self.backend.generate(conversations)]

    def compare(self, prompts: list[str], responses_a: list[str], responses_b: list[str],
                ground_truths: list) -> list[dict]:
        """Pairwise: per pair, the result dict whose "score" is the preference for A (1 / 0 / 0.5 a tie)."""
        conversations = [self.template(p, a, b, reference_text(g))
                         for p, a, b, g in zip(prompts, responses_a, responses_b, ground_truths)]
        return [self._result(reply) for reply in self.backend.generate(conversations)]

    def _result(self, reply: str | JudgeError) -> dict:
        base = {"score": 0.0, "acc": False, "formatted": False, "error": None, "timeout": False}
        if isinstance(reply, JudgeError):
            return {**base, "extra": {"judge_output": None}, "error": f"JudgeError: {reply}",
                    "timeout": reply.timeout, "judge": "failed"}
        try:
            score = float(self.parser(reply))
        except Exception as e:  # noqa: BLE001 - a user parser's error is a parse error of this reply
            why = e if isinstance(e, JudgeParseError) else f"{type(e).__name__}: {e}"
            return {**base, "extra": {"judge_output": reply}, "judge": "parse_error",
                    "error": f"reward.judge.parser={self.config.parser!r} found no verdict in the reply of "
                             f"{self.name}: {why}"}
        if not 0.0 <= score <= 1.0:
            return {**base, "extra": {"judge_output": reply}, "judge": "parse_error",
                    "error": f"reward.judge.parser={self.config.parser!r} returned {score!r}, outside [0, 1]"}
        return {**base, "score": score, "acc": score >= 0.5, "formatted": True,
                "extra": {"judge_output": reply}, "judge": "ok"}
