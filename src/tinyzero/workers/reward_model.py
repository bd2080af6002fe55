"""RewardModelWorker: a sequence-classification reward model scoring (prompt, response) pairs.

    wg = WorkerGroup(resource_pool=pool, cls_with_init=ClassWithInitArgs(RewardModelWorker, rm_config))
    wg.init_model()
    batch = batch.union(wg.compute_rm_score(batch))   # rm_scores (rows, R)

The score of a row sits at its last valid response token (zeros elsewhere), so it adds to
rule-based token-level scores directly. When the reward model uses another tokenizer than
the policy (`input_tokenizer` set), the prompt and response are decoded with the policy's
tokenizer and re-encoded with the reward model's (chat template when the row carries the
chat messages in `raw_prompt`).
"""

from __future__ import annotations

import torch

from tinyzero.distributed.parallel_dims import ParallelDims
from tinyzero.protocol import DataProto
from tinyzero.single_controller import Dispatch, Worker, register
from tinyzero.workers.batching import make_micro_batches, restore_order
from tinyzero.workers.common import (
    offload_after_init,
    on_device,
    prepare_role_model,
    reshard,
    response_mask_of,
)
from tinyzero.workers.config import RewardModelConfig, role_layout


def place_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(rows,) scores -> (rows, R) with each score at the row's last valid response token."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (response_mask.long().sum(-1) - 1).clamp(min=0)  # (rows,)
    out[torch.arange(len(last)), last] = scores.float()
    return out


def retokenize(data: DataProto, src, dst, max_length: int | None = None) -> DataProto:
    """Decode rows (input_ids / attention_mask / responses) with the policy tokenizer `src`, re-encode
    them with the reward model's `dst`, left-padded, keeping the last `max_length` tokens. With chat
    messages in non_tensor_batch["raw_prompt"] and a chat template on `dst`, a row is the template over
    the messages plus the response as the assistant turn; otherwise prompt text + response text (+ dst's
    eos token when the response ended with src's)."""
    r = data.batch["responses"].shape[1]
    ids, attn = data.batch["input_ids"], data.batch["attention_mask"]
    texts = []
    raw = data.non_tensor_batch.get("raw_prompt")
    for i in range(len(data)):
        prompt_ids = ids[i, :-r][attn[i, :-r].bool()].tolist()
        resp_ids = ids[i, -r:][attn[i, -r:].bool()].tolist()
        response = src.decode(resp_ids, skip_special_tokens=True)
        if raw is not None and getattr(dst, "chat_template", None):
            chat = list(raw[i]) + [{"role": "assistant", "content": response}]
            texts.append(dst.apply_chat_template(chat, tokenize=False))
        else:
            # A finished response keeps its end marker, in the reward model's own spelling.
            ended = bool(resp_ids) and resp_ids[-1] == src.eos_token_id
            texts.append(src.decode(prompt_ids, skip_special_tokens=True) + response
                         + (dst.eos_token or "" if ended else ""))
    enc = dst(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    new_ids, new_attn = enc["input_ids"], enc["attention_mask"]
    if max_length is not None and new_ids.shape[1] > max_length:
        new_ids, new_attn = new_ids[:, -max_length:], new_attn[:, -max_length:]
    pos = (new_attn.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": new_ids, "attention_mask": new_attn, "position_ids": pos})


class RewardModelWorker(Worker):
    """Scores from a learned reward model, sharded with FSDP2 over the pool."""

    def __init__(self, config: RewardModelConfig, dims: ParallelDims | None = None):
        """`dims` comes from the run plan (tinyzero.plan); a worker built outside a run derives it."""
        super().__init__()
        self.config = config
        self.dims = role_layout(config, self.world_size) if dims is None else dims
        self.model = None
        self.tokenizer = None
        self.input_tokenizer = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from tinyzero.models.loading import load_tokenizer

        cfg = self.config
        self.tokenizer = load_tokenizer(cfg.model.resolved_tokenizer_path, cfg.model.trust_remote_code)
        if cfg.input_tokenizer:
            self.input_tokenizer = load_tokenizer(cfg.input_tokenizer, cfg.model.trust_remote_code)
        self.model = prepare_role_model(self, cfg.model, cfg.fsdp_config, self.dims, "reward", trainable=False)
        offload_after_init(self.model, cfg.fsdp_config)

    @torch.no_grad()
    def _scores(self, data: DataProto) -> torch.Tensor:
        """One scalar per row, read at the row's last attended position."""
        cfg = self.config
        data = data.select(batch_keys=["input_ids", "attention_mask", "position_ids"])
        micros, parts = make_micro_batches(data, cfg.micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                           cfg.forward_max_token_len_per_gpu, self.process_group)
        scores = []
        for micro in micros:
            attn = micro.batch["attention_mask"]
            used = attn.bool().any(0).nonzero()
            keep = slice(int(used[0]), int(used[-1]) + 1) if len(used) else slice(0, attn.shape[1])
            ids, attn, pos = micro.batch["input_ids"][:, keep], attn[:, keep], micro.batch["position_ids"][..., keep]
            token_scores = self.model.token_scores(ids.to(self.device), attn.to(self.device),
                                                   pos.to(self.device)).cpu()  # (b, seq)
            # The last attended column of each row (works for left and right padding).
            cols = torch.arange(attn.shape[1]).expand_as(attn)
            last = (cols * attn).argmax(-1)
            scores.append(token_scores[torch.arange(len(last)), last])
        reshard(self.model)
        return restore_order(torch.cat(scores), parts)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """rm_scores (rows, R): the reward model's score at each row's last valid response token."""
        model_input = data if self.input_tokenizer is None else \
            retokenize(data, self.input_tokenizer, self.tokenizer, self.config.max_length)
        with on_device(self.model, self.config.fsdp_config, self.device):
            scores = self._scores(model_input)
        return DataProto.from_dict(tensors={"rm_scores": place_at_last_token(scores, response_mask_of(data))})
