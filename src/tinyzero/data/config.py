"""DataConfig: where the data is and how prompts become batches (the `data` section of the root config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = ["DataConfig", "TRUNCATION_MODES"]

Truncation = Literal["error", "left", "right", "filter"]
TRUNCATION_MODES = get_args(Truncation)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training parquet file(s) in the RL row format (data_source, prompt, ability, reward_model, extra_info)."""

    val_files: list[str] = field(default_factory=list)
    """Validation parquet file(s); empty disables validation."""

    prompt_key: str = "prompt"
    """Column holding the chat messages of the prompt."""

    max_prompt_length: int = 512
    """Prompts are left-padded to this many tokens; longer ones follow `truncation`."""

    max_response_length: int = 512
    """Most tokens generated per response."""

    train_batch_size: int = 256
    """Prompts per training step (before repeating each prompt rollout.n times)."""

    val_batch_size: int | None = None
    """Prompts per validation batch; None puts the whole validation set in one batch."""

    truncation: Truncation = "error"
    """Over-long prompts: "error" (stop when the dataset loads, naming the first such row and the
    length that would fit them all), "left" (keep the last tokens), "right" (keep the first tokens) or
    "filter" (drop them when the dataset loads; the count is printed). "error" and "filter" tokenize
    every prompt once at load."""

    filter_overlong_prompts: bool = False
    """veRL's switch: drop prompts longer than max_prompt_length when the dataset loads (the count is
    printed). True makes `truncation` "filter": nothing is left to truncate, as in veRL, where the
    filter runs before truncation."""

    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (instruct models); False uses the message
    contents as raw text (base models, and TinyZero's pre-rendered countdown prompts)."""

    return_raw_chat: bool = False
    """Also put the prompt messages in the batch as the non-tensor `raw_prompt`."""

    shuffle: bool = True
    """Shuffle training prompts each epoch (a seeded permutation, identical on every rank)."""

    seed: int = 1
    """Seed of the training sampler; epoch e uses the permutation of seed + e."""

    drop_last: bool = True
    """Drop the last incomplete training batch of an epoch."""

    response_key: str = "response"
    """SFT: column holding the response text (single-turn rows)."""

    messages_key: str | None = None
    """SFT: column holding multi-turn chat messages; set it to train on every assistant turn."""

    chosen_key: str = "chosen"
    """Reward-model pairs: column holding the preferred response."""

    rejected_key: str = "rejected"
    """Reward-model pairs: column holding the dispreferred response."""

    max_length: int = 1024
    """SFT and reward-model datasets: total tokens (prompt + response), right-padded to this length."""

    def __post_init__(self):
        if isinstance(self.train_files, str):
            self.train_files = [self.train_files]
        if isinstance(self.val_files, str):
            self.val_files = [self.val_files]
        self.train_files = list(self.train_files)
        self.val_files = list(self.val_files)
        if self.filter_overlong_prompts:
            self.truncation = "filter"
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {self.truncation!r}")
        for name in ("max_prompt_length", "max_response_length", "train_batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.val_batch_size is not None and self.val_batch_size < 1:
            raise ValueError(f"data.val_batch_size must be >= 1 or None (whole set), got {self.val_batch_size}")
        if not self.prompt_key:
            raise ValueError("data.prompt_key must name the prompt column (usually 'prompt')")
