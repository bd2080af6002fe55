"""The multi-turn agent loop as a rollout engine wrapping another engine (native, vLLM, ...).

    engine = AgentRollout(inner_engine, rollout_config, tokenizer)   # built by build_rollout when
    out = engine.generate_sequences(prompts)                          # rollout.multi_turn.enable

Per sample, independently within the batch: generate until a stop token or, with tools and
multi_turn.stop_at_tool_call, the end of a tool call (`</tool_call>`, kept in the response); parse
the tool calls (or hand the turn to the environment); run the tools in the worker pool; append the
observation as the chat template's tokens; continue, up to multi_turn.max_turns assistant turns and
rollout.response_length response tokens in all. Every generate call of the inner engine takes the
samples still active, whatever turn each is in, so the engine batches across turns.

Ending a turn at the tool call: the inner engine gets the tag's token ids as a stop sequence
(meta_info["stop_sequences"]; one id, e.g. Qwen2.5's `</tool_call>` token, is a stop token), so it
stops right after sampling them. A model may spell the tag in other tokens (a merge with the text
around it); the loop then keeps the turn's tokens up to the one that completes the tag in the
decoded text and drops the rest, unused: the kept tokens are exactly what was sampled, and the
engine's sampling of them did not depend on what came after.

The output has the keys every engine returns (rollout/outputs.py). `responses` holds the sampled
ids and the observation ids in order, exactly as sampled (never decoded and re-encoded);
`attention_mask` is 1 over all of them (observations are attended to normally) and `response_mask`
is 1 only on the model's tokens, so observations get no loss, KL or entropy; `rollout_log_probs`
are the inner engine's, 0 on observations. Non-tensor per sample: `stop_reason` (eos: the model
answered without a tool call or the environment said done; max_turns; budget: the token budget ran
out, or the next observation did not fit; tool_error: with multi_turn.stop_on_tool_error), `num_turns`,
`num_tool_calls` (calls answered, errors included), `num_tool_errors`, `num_tool_timeouts`,
`num_observation_tokens`, and `env_reward` with an environment. agent/* metrics are computed from
those fields (metrics.agent_metrics) by the driver, on the batch gathered from every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tinyzero.agent.chat import ObservationRenderer
from tinyzero.agent.environment import load_environment
from tinyzero.agent.parser import CLOSE, ToolCallError, parse_tool_calls
from tinyzero.agent.pool import ToolPool, ToolResult
from tinyzero.agent.tools import load_tool, tool_timeout
from tinyzero.protocol import DataProto
from tinyzero.rollout.engine import resolve_sampling_params
from tinyzero.rollout.outputs import build_output, check_prompt_batch, repeat_prompts


@dataclass
class _Sample:
    """One row's state through the loop."""

    prompt: list[int]
    prompt_pos: list[int]
    ids: list[int] = field(default_factory=list)  # sampled and observation tokens, in order
    model: list[int] = field(default_factory=list)  # 1 on sampled tokens
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    observation_tokens: int = 0
    env: object = None
    env_reward: float = 0.0
    stop: str | None = None
    at_call: bool = False  # the latest turn ended with a tool call's closing tag
    pending: list = field(default_factory=list)  # this turn's observation messages / tool calls


class AgentRollout:
    """A RolloutEngine that runs the multi-turn loop around `inner` (see the module docstring)."""

    def __init__(self, inner, config, tokenizer):
        self.inner = inner
        self.config = config
        self.mt = config.multi_turn
        self.tokenizer = tokenizer
        self.renderer = ObservationRenderer(tokenizer)
        self.tools = {}
        for spec in self.mt.tools:
            tool = load_tool(spec)
            self.tools[tool.name] = tool
        self.env_factory = load_environment(self.mt.environment) if self.mt.environment else None
        # The closing tag as a stop sequence (token ids as the tokenizer spells the tag alone).
        self.call_stop = (tokenizer.encode(CLOSE, add_special_tokens=False)
                          if self.tools and self.mt.stop_at_tool_call else [])
        self._pool: ToolPool | None = None
        self.num_calls = 0

    # ------------------------------------------------------------------ the engine interface
    def update_weights(self, named_tensors):
        return self.inner.update_weights(named_tensors)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.inner.wake_up(tags)

    def memory_metrics(self) -> dict[str, float]:
        return self.inner.memory_metrics()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self.inner.shutdown()

    @property
    def pool(self) -> ToolPool:
        if self._pool is None:
            self._pool = ToolPool(list(self.mt.tools), self.mt.num_tool_workers, self.mt.tool_memory_mb,
                                  self.mt.max_observation_chars)
        return self._pool

    # ------------------------------------------------------------------ the loop
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        check_prompt_batch(prompts)
        params = resolve_sampling_params(self.config, prompts.meta_info, seed=0)  # n, budget, stop ids
        self.num_calls += 1
        ids, mask, pos = repeat_prompts(prompts, params.n)
        non_tensors = {k: np.repeat(v, params.n, axis=0) for k, v in prompts.non_tensor_batch.items()}
        samples = [_Sample(ids[i][mask[i].bool()].tolist(), pos[i][mask[i].bool()].tolist())
                   for i in range(ids.shape[0])]
        replaced = self._reset_environments(samples, non_tensors) if self.env_factory else False
        stops = set(params.stop_token_ids)
        meta_out: dict = {}
        turn = 0
        while active := [s for s in samples if s.stop is None]:
            meta_out = self._generate_turn(active, prompts.meta_info, params.response_length, turn)
            for s in active:
                self._after_turn(s, stops)
            self._run_tools([s for s in active if s.stop is None and s.pending and self.env_factory is None])
            for s in active:
                if s.stop is None:
                    self._append_observation(s, params.response_length)
            turn += 1
        return self._assemble(samples, (ids, mask, pos), replaced, params, meta_out, non_tensors)

    def _reset_environments(self, samples: list[_Sample], non_tensors: dict) -> bool:
        """One environment per sample; reset messages replace the prompt. True if any did."""
        replaced = False
        for i, s in enumerate(samples):
            s.env = self.env_factory()
            row = {k: v[i] for k, v in non_tensors.items()}
            row.update(prompt_ids=list(s.prompt), prompt_text=self.tokenizer.decode(s.prompt))
            messages = s.env.reset(row)
            if messages:
                s.prompt = self.renderer.prompt_ids(messages)
                if len(s.prompt) > self.config.prompt_length:
                    raise ValueError(f"rollout.multi_turn.environment: reset() of sample {i} gave a prompt of "
                                     f"{len(s.prompt)} tokens, more than rollout.prompt_length="
                                     f"{self.config.prompt_length}; raise rollout.prompt_length")
                s.prompt_pos = list(range(len(s.prompt)))
                replaced = True
                if "raw_prompt_ids" in non_tensors:  # keep the batch's unpadded prompt ids truthful
                    non_tensors["raw_prompt_ids"][i] = list(s.prompt)
        return replaced

    def _generate_turn(self, active: list[_Sample], meta_info: dict, budget: int, turn: int) -> dict:
        """One inner-engine call on every active sample (its prompt + response so far, left-padded)."""
        length = max(budget - len(s.ids) for s in active)
        width = max(len(s.prompt) + len(s.ids) for s in active)
        pad = int(meta_info["pad_token_id"])
        ids = torch.full((len(active), width), pad, dtype=torch.long)
        mask = torch.zeros(len(active), width, dtype=torch.long)
        pos = torch.zeros(len(active), width, dtype=torch.long)
        for r, s in enumerate(active):
            ctx = s.prompt + s.ids
            last = s.prompt_pos[-1] if s.prompt_pos else -1
            ids[r, width - len(ctx):] = torch.tensor(ctx)
            mask[r, width - len(ctx):] = 1
            pos[r, width - len(ctx):] = torch.tensor(s.prompt_pos + list(range(last + 1, last + 1 + len(s.ids))))
        meta = {**meta_info, "n": 1, "response_length": length}
        if self.call_stop:
            meta["stop_sequences"] = [*meta_info.get("stop_sequences", []), self.call_stop]
        if "seed" in meta_info:  # a per-step seed: each turn draws its own noise
            meta["seed"] = (int(meta_info["seed"]) * 1_000_003 + turn * 7_919) % 2**62
        out = self.inner.generate_sequences(DataProto.from_dict(
            {"input_ids": ids, "attention_mask": mask, "position_ids": pos}, meta_info=meta))
        valid = out.batch["response_mask"].bool()
        for r, s in enumerate(active):
            room = budget - len(s.ids)
            toks = out.batch["responses"][r][valid[r]][:room].tolist()
            end = self._call_end(toks) if self.call_stop else None
            s.at_call = end is not None
            toks = toks[:end]
            s.ids += toks
            s.model += [1] * len(toks)
            s.log_probs += out.batch["rollout_log_probs"][r][valid[r]][:len(toks)].tolist()
            s.turns += 1
            s.pending = [toks[-1] if toks else None]  # the turn's last token, then what it asks for
        return {k: v for k, v in out.meta_info.items() if k != "metrics"}

    def _call_end(self, toks: list[int]) -> int | None:
        """How many of a turn's tokens reach the end of its first tool call's closing tag, as decoded text
        (the tag may span tokens in any way); None when the turn has no closing tag."""
        if CLOSE not in self.tokenizer.decode(toks):
            return None
        lo, hi = 1, len(toks)  # the shortest prefix whose text holds the tag (longer prefixes all do)
        while lo < hi:
            mid = (lo + hi) // 2
            if CLOSE in self.tokenizer.decode(toks[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _after_turn(self, s: _Sample, stops: set) -> None:
        """Decide whether the sample ends after this turn; queue what it asks for otherwise."""
        last = s.pending[0]
        turn_ids = s.ids[len(s.ids) - _turn_length(s):]
        if last not in stops and not s.at_call:
            s.stop = "budget"
            return
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        if self.env_factory is not None:
            observation, reward, done = s.env.step(text)
            s.env_reward += float(reward)
            if done:
                s.stop = "eos"
            else:
                s.pending.append({"role": "user", "content": observation or ""})
        else:
            calls = parse_tool_calls(text)
            if not calls:
                s.stop = "eos"
            s.pending += calls
        if s.stop is None and s.turns >= self.mt.max_turns:
            s.stop = "max_turns"

    def _run_tools(self, samples: list[_Sample]) -> None:
        """Every queued call of every sample in one pool batch; pending becomes [last id, *tool messages]."""
        jobs, slots = [], []
        for s in samples:
            for j, call in enumerate(s.pending[1:]):
                if isinstance(call, ToolCallError):
                    s.pending[1 + j] = ToolResult(call.message, error=True)
                elif j >= self.mt.max_tool_calls_per_turn:
                    s.pending[1 + j] = ToolResult(f"more than {self.mt.max_tool_calls_per_turn} tool calls in "
                                                  "one turn", error=True)
                elif call.name not in self.tools:
                    s.pending[1 + j] = ToolResult(f"unknown tool {call.name!r}; available: {sorted(self.tools)}",
                                                  error=True)
                else:
                    jobs.append((call.name, call.arguments, tool_timeout(self.tools[call.name],
                                                                         self.mt.tool_timeout_s)))
                    slots.append((s, 1 + j))
        for (s, j), result in zip(slots, self.pool.run(jobs) if jobs else []):
            s.pending[j] = result
        for s in samples:
            results = s.pending[1:]
            s.tool_calls += len(results)
            s.tool_errors += sum(r.error for r in results)
            s.tool_timeouts += sum(r.timeout for r in results)
            if self.mt.stop_on_tool_error and any(r.error for r in results):
                s.stop = "tool_error"
            s.pending[1:] = [{"role": "tool", "content": f"tool error: {r.text}" if r.error else r.text}
                             for r in results]

    def _append_observation(self, s: _Sample, budget: int) -> None:
        obs = self.renderer.observation_ids(s.pending[1:], s.pending[0])
        s.pending = []
        if len(s.ids) + len(obs) >= budget:  # no room left for the model to answer
            s.stop = "budget"
            return
        s.ids += obs
        s.model += [0] * len(obs)
        s.log_probs += [0.0] * len(obs)
        s.observation_tokens += len(obs)

    # ------------------------------------------------------------------ output
    def _assemble(self, samples, prompt_rows, replaced: bool, params, meta: dict, non_tensors: dict) -> DataProto:
        rows, R = len(samples), params.response_length
        if replaced:
            width = max(len(s.prompt) for s in samples)
            pids = torch.full((rows, width), params.pad_token_id, dtype=torch.long)
            pmask = torch.zeros(rows, width, dtype=torch.long)
            for i, s in enumerate(samples):
                pids[i, width - len(s.prompt):] = torch.tensor(s.prompt)
                pmask[i, width - len(s.prompt):] = 1
            ppos = (pmask.cumsum(-1) - 1).clamp(min=0)
        else:
            pids, pmask, ppos = prompt_rows
        responses = torch.full((rows, R), params.pad_token_id, dtype=torch.long)
        attention = torch.zeros(rows, R, dtype=torch.long)
        model = torch.zeros(rows, R, dtype=torch.long)
        log_probs = torch.zeros(rows, R, dtype=torch.float32)
        for i, s in enumerate(samples):
            k = len(s.ids)
            responses[i, :k] = torch.tensor(s.ids, dtype=torch.long)
            attention[i, :k] = 1
            model[i, :k] = torch.tensor(s.model, dtype=torch.long)
            log_probs[i, :k] = torch.tensor(s.log_probs, dtype=torch.float32)
        extra = {"stop_reason": [s.stop for s in samples], "num_turns": [s.turns for s in samples],
                 "num_tool_calls": [s.tool_calls for s in samples],
                 "num_tool_errors": [s.tool_errors for s in samples],
                 "num_tool_timeouts": [s.tool_timeouts for s in samples],
                 "num_observation_tokens": [s.observation_tokens for s in samples]}
        if self.env_factory is not None:
            extra["env_reward"] = [s.env_reward for s in samples]
        out = build_output(pids, pmask, ppos, responses, attention, log_probs, meta_info=meta,
                           non_tensors={**non_tensors, **extra})
        out.batch["response_mask"] = model
        return out


def _turn_length(s: _Sample) -> int:
    """Tokens of the latest turn: the sampled ids after the last observation token."""
    k = len(s.model)
    while k > 0 and s.model[k - 1] == 1:
        k -= 1
    return len(s.model) - k


def build_agent_engine(config, model_path: str, tokenizer=None, **kwargs):
    """The engine `config` names (tinyzero.rollout.build_rollout, with its keyword arguments), inside the
    agent loop when rollout.multi_turn.enable: what the rollout worker generates with."""
    from tinyzero.rollout.registry import build_rollout

    engine = build_rollout(config, model_path, tokenizer, **kwargs)
    if not config.multi_turn.enable:
        return engine
    return wrap_engine(engine, config, tokenizer, model_path, kwargs.get("trust_remote_code", False))


def wrap_engine(engine, config, tokenizer=None, model_path: str = "", trust_remote_code: bool = False) -> AgentRollout:
    """`engine` inside the agent loop; the tokenizer is read from model_path when not given."""
    if tokenizer is None:
        from tinyzero.models.loading import load_tokenizer

        tokenizer = load_tokenizer(model_path, trust_remote_code)
    return AgentRollout(engine, config, tokenizer)
