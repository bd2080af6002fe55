"""The in-process judge on one of tinyzero's rollout engines (reward.judge.engine=native or vllm).

    backend = EngineJudgeBackend(JudgeConfig(enable=True, model_path="/models/judge", engine="native"))
    replies = backend.generate([[{"role": "user", "content": "..."}], ...])

The engine is built through the public rollout API (`tinyzero.rollout.build_rollout`) with the judge's
checkpoint loaded at build time (load_weights: the judge never trains, so nothing syncs into it), one
response per prompt, greedy, reward.judge.max_new_tokens new tokens. Prompts are rendered and tokenized
as HFJudgeBackend renders them (the tokenizer's chat template, left padding, reward.judge.batch_size per
call), stop at the generation config's end ids, and replies are decoded as HFJudgeBackend decodes them
(the response tokens without special tokens), so for the same weights and dtype the replies are HF
generate's up to kernel rounding.

A rendered prompt longer than reward.judge.max_prompt_length tokens gets no reply (a JudgeError: a
judge fault under reward.on_error) rather than failing its whole batch; vLLM's max_model_len is that
length plus max_new_tokens.

Engines are cached per (engine, path, dtype, device, lengths, batch size): the train and validation
reward managers share one.
"""

from __future__ import annotations

import torch

from tinyzero.rewards.judge import JudgeError, default_device, render_conversation
from tinyzero.rewards.judge_config import JudgeConfig

__all__ = ["EngineJudgeBackend"]

_ENGINES: dict[tuple, tuple] = {}
"""Cache key -> (tokenizer, end ids, engine)."""


def _end_ids(path: str, tokenizer) -> list[int]:
    """The ids generation stops at: the generation config's eos_token_id (HF generate's), else the tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def _rollout_config(config: JudgeConfig):
    from tinyzero.rollout import RolloutConfig

    return RolloutConfig(name=config.engine, n=1, do_sample=False, temperature=0.0, seed=0,
                         prompt_length=config.max_prompt_length, response_length=config.max_new_tokens,
                         dtype=config.dtype, max_num_seqs=config.batch_size, tensor_model_parallel_size=1,
                         gpu_memory_utilization=config.gpu_memory_utilization, free_cache_engine=False)


def _build(config: JudgeConfig, device: torch.device) -> tuple:
    from transformers import AutoTokenizer

    from tinyzero.rollout import ENGINES, build_rollout

    path = config.model_path
    if config.engine == "vllm":
        reason = ENGINES["vllm"].unavailable()
        if reason is not None:
            raise ValueError(f"reward.judge.engine=vllm but {reason}; install vllm or set reward.judge.engine=native")
        if not torch.distributed.is_initialized():
            raise ValueError("reward.judge.engine=vllm runs vLLM in-process over torch.distributed (as the vLLM "
                             "rollout does); start under torchrun (train.py initializes the process group) or set "
                             "reward.judge.engine=native")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        engine = build_rollout(_rollout_config(config), path, device=device, load_weights=True)
    except OSError as e:
        raise ValueError(f"reward.judge.model_path={path!r} could not be loaded as an HF causal LM: {e}"[:600]) from e
    return tokenizer, _end_ids(path, tokenizer), engine


class EngineJudgeBackend:
    """A frozen judge on a rollout engine on this rank, greedy, batched (see the module docstring)."""

    def __init__(self, config: JudgeConfig, device: torch.device | None = None):
        self.config, self.device = config, device if device is not None else default_device()
        self.name = f"the in-process judge {config.model_path} ({config.engine} engine)"
        key = (config.engine, config.model_path, config.dtype, str(self.device), config.max_prompt_length,
               config.max_new_tokens, config.batch_size, config.gpu_memory_utilization)
        if key not in _ENGINES:
            _ENGINES[key] = _build(config, self.device)
        self.tokenizer, self.end_ids, self.engine = _ENGINES[key]

    def generate(self, conversations: list[list[dict]]) -> list[str | JudgeError]:
        replies: list[str | JudgeError] = []
        size = self.config.batch_size
        for start in range(0, len(conversations), size):
            replies.extend(self._generate_batch(conversations[start:start + size]))
        return replies

    def _generate_batch(self, conversations: list[list[dict]]) -> list[str | JudgeError]:
        from tinyzero.protocol import DataProto

        rendered = [render_conversation(self.tokenizer, c) for c in conversations]
        enc = self.tokenizer([t for t, _ in rendered], return_tensors="pt", padding=True,
                             add_special_tokens=rendered[0][1])  # left-padded
        lengths = enc["attention_mask"].sum(-1).tolist()
        limit = self.config.max_prompt_length
        fits = [i for i, n in enumerate(lengths) if n <= limit]
        replies: list[str | JudgeError] = [
            JudgeError(f"{self.name}: the judge prompt of {n} tokens is longer than reward.judge.max_prompt_length="
                       f"{limit}; raise it or shorten the template") for n in lengths]
        if not fits:
            return replies
        width = max(lengths[i] for i in fits)  # the rows that fit, without the padding only longer rows needed
        ids, mask = enc["input_ids"][fits, -width:], enc["attention_mask"][fits, -width:]  # (batch, width)
        batch = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": mask, "position_ids": torch.clamp(mask.cumsum(-1) - 1, min=0)},  # as the dataloader's
            meta_info={"pad_token_id": self.tokenizer.pad_token_id, "eos_token_id": self.end_ids, "n": 1,
                       "do_sample": False, "response_length": self.config.max_new_tokens})
        out = self.engine.generate_sequences(batch).batch
        responses, valid = out["responses"].cpu(), out["response_mask"].sum(-1).tolist()  # (batch, new), (batch,)
        decoded = self.tokenizer.batch_decode([responses[k, :n].tolist() for k, n in enumerate(valid)],
                                              skip_special_tokens=True)
        for i, text in zip(fits, decoded):
            replies[i] = text
        return replies
