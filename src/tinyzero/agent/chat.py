"""Observation tokens from the tokenizer's chat template, appended after the model's own tokens.

The model's turn ends with a stop token it sampled (for ChatML, `<|im_end|>`). What follows in the
template's rendering of the whole conversation (the rest of the assistant turn's closing, e.g. the
"\\n" after `<|im_end|>`, then the tool or user turn, then the next generation prompt) is the
observation. It is read off the template once per observation as a text difference on a probe
conversation: render [user, assistant] and [user, assistant, *observation messages] (the latter
with the generation prompt); the second must extend the first (the prefix property, checked), and
the extension plus the closing after the stop token is tokenized on its own. The model's tokens
are never decoded and re-encoded, so the trainer sees exactly the sampled ids.

Where this is exact: templates that render each message independently of later ones (ChatML,
Qwen2.5 with its <tool_response> user turns, SmolLM2, Llama-3's eot_id turns); the test suite
checks per-turn concatenation == the whole conversation's tokens for ChatML and Qwen2.5 templates.
Where it is not: templates that rewrite earlier turns once later messages exist (Qwen3 and
DeepSeek-R1 drop an earlier turn's <think> reasoning: `rewrites_history`, warned at start; the
trainer keeps the sampled tokens, which then differ from the template's rendering of the whole
conversation), that render the observation so that it changes the earlier text (the prefix check
fails: a ValueError at start), or that reject a tool / user message after an assistant turn
(a ValueError naming the roles). A tokenizer without a chat template gets a plain-text format
("\\n<tool_response>\\n...\\n</tool_response>\\n" per tool result, the text itself for users).
"""

from __future__ import annotations

import warnings

PROBE_USER = "tinyzero probe question"
PROBE_ASSISTANT = "tinyzero probe answer"


class ObservationRenderer:
    """`observation_ids(messages, last_token_id)`: the tokens to append after a model turn."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials = set(getattr(tokenizer, "all_special_tokens", [])) | {t.content for t in decoder.values()
                                                                         if getattr(t, "special", False)}
        self._specials = sorted((t for t in specials if t), key=len, reverse=True)
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        if not self.has_template:
            return
        self._base_conv = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_ASSISTANT}]
        self._base = self._render(self._base_conv, False)
        at = self._base.rfind(PROBE_ASSISTANT)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content verbatim; "
                             "multi-turn rollout needs one that does (set model.tokenizer_path to another)")
        self._closing = self._base[at + len(PROBE_ASSISTANT):]  # e.g. "<|im_end|>\n"
        self.observation_text([{"role": "tool", "content": "probe result"}], None)  # prefix-property check
        self.rewrites_history = self._rewrites_reasoning()
        if self.rewrites_history:
            warnings.warn("the chat template rewrites earlier assistant turns once later messages follow (it "
                          "drops their <think> reasoning); the trainer sees the sampled tokens as they were, "
                          "which then differ from the template's rendering of the whole conversation",
                          stacklevel=2)

    def _rewrites_reasoning(self) -> bool:
        """True if an assistant turn with <think> reasoning is rendered differently once a message follows."""
        content = "<think>\ntinyzero probe reasoning\n</think>\n\n" + PROBE_ASSISTANT
        conv = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": content}]
        alone = self._render(conv, False)
        followed = self._render(conv + [{"role": "user", "content": PROBE_USER}], True)
        return not followed.startswith(alone)

    def _render(self, conv: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(conv, add_generation_prompt=generation_prompt, tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja raises its own errors for unsupported roles
            roles = [m["role"] for m in conv]
            raise ValueError(f"the chat template cannot render a conversation with roles {roles}: {e}; "
                             "multi-turn rollout needs tool / user turns after an assistant turn") from e

    def defang(self, text: str) -> str:
        """`text` without special-token strings: a tool's output cannot forge turns (an `<|im_end|>` in
        it would otherwise be encoded as the real end-of-turn token)."""
        for token in self._specials:
            text = text.replace(token, "")
        return text

    def observation_text(self, messages: list[dict], last_token: str | None) -> str:
        """The text after a model turn that ended with `last_token` (its string; None: not a stop).
        Special-token strings inside the messages' contents are removed (see `defang`)."""
        messages = [{**m, "content": self.defang(m["content"])} for m in messages]
        if not self.has_template:
            parts = [f"<tool_response>\n{m['content']}\n</tool_response>" if m["role"] == "tool" else m["content"]
                     for m in messages]
            return "\n" + "\n".join(parts) + "\n"
        full = self._render(self._base_conv + list(messages), True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders an earlier turn differently once a "
                             f"{messages[0]['role']!r} message follows it (the prefix property fails), so "
                             "observation tokens cannot be appended token in / token out; use a template "
                             "that renders each message independently (ChatML, Qwen2.5)")
        closing = self._closing
        if last_token and closing.startswith(last_token):
            closing = closing[len(last_token):]  # the model sampled the turn's end token itself
        return closing + full[len(self._base):]

    def observation_ids(self, messages: list[dict], last_token_id: int | None) -> list[int]:
        """Token ids of `observation_text` (the model's sampled ids are left untouched)."""
        last = None if last_token_id is None else self.tokenizer.convert_ids_to_tokens(int(last_token_id))
        return self.tokenizer.encode(self.observation_text(messages, last), add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A conversation rendered with the generation prompt (an environment's reset messages)."""
        if not self.has_template:
            return self.tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=False)
        return self.tokenizer.encode(self._render(messages, True), add_special_tokens=False)
