"""Shared pieces of the worker tests: a synthetic PPO batch and a float64 reference of the actor loss.

The reference is written out from the formulas (PPO dual-clip surrogate, entropy, low-variance
KL, token-mean over the whole mini-batch) on a plain HF model, independent of the worker code.
"""

from __future__ import annotations

import torch

PAD_ID = 0


def make_batch(num_rows: int = 8, prompt_len: int = 7, response_len: int = 6, vocab: int = 250, seed: int = 0):
    """Left-padded prompts + right-padded responses with varied lengths (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    p, r = prompt_len, response_len
    ids = torch.randint(3, vocab, (num_rows, p + r), generator=g)
    attn = torch.zeros(num_rows, p + r, dtype=torch.long)
    for i in range(num_rows):
        lp = 2 + (i * 3) % (p - 1)  # 2..p
        lr = 1 + (i * 5) % r  # 1..r
        attn[i, p - lp:p] = 1
        attn[i, p:p + lr] = 1
    ids = torch.where(attn.bool(), ids, torch.full_like(ids, PAD_ID))
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    response_mask = attn[:, p:].float()
    return {
        "input_ids": ids, "attention_mask": attn, "position_ids": pos, "prompts": ids[:, :p],
        "responses": ids[:, p:], "response_mask": response_mask,
        "advantages": torch.randn(num_rows, r, generator=g) * response_mask,
        "noise_old": torch.randn(num_rows, r, generator=g) * 0.3,
        "noise_ref": torch.randn(num_rows, r, generator=g) * 0.2,
        "returns": torch.randn(num_rows, r, generator=g) * response_mask,
        "noise_values": torch.randn(num_rows, r, generator=g) * 0.5,
        "noise_rollout": torch.randn(num_rows, r, generator=g) * 0.5,
    }


def hf_response_log_probs(model, batch: dict, temperature: float = 1.0, with_entropy: bool = False):
    """log_softmax(logits / T) at the responses, from the full HF logits; (rows, R)."""
    r = batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, -r - 1:-1] / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """A loss matrix over the whole batch as each loss_agg_mode defines it."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum-norm":  # Dr. GRPO: token sums / response length, mean over rows
        return (loss_mat * mask).sum() / mask.shape[1] / mask.shape[0]
    raise ValueError(mode)


def reference_actor_loss(model, batch: dict, clip_low: float, clip_high: float, clip_c: float,
                         entropy_coeff: float, kl_coef: float, temperature: float = 1.0,
                         loss_agg_mode: str = "token-mean", tis_cap: float = -1.0):
    """PPO loss of the whole batch (dual clip, entropy bonus, low_var_kl loss), aggregated by mode."""
    mask = batch["response_mask"]
    logp, entropy = hf_response_log_probs(model, batch, temperature, with_entropy=True)
    adv, old = batch["advantages"], batch["old_log_probs"]
    log_ratio = (logp - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(-adv * clip_c, clipped)
    pg = torch.where(adv < 0, dual, clipped)
    if tis_cap > 0:  # truncated importance sampling: weight by min(pi_old / pi_rollout, cap)
        pg = pg * torch.clamp(torch.exp(old - batch["rollout_log_probs"]), max=tis_cap)
    pg_loss = aggregate(pg, mask, loss_agg_mode)
    ent = aggregate(entropy, mask, loss_agg_mode)
    kl = batch["ref_log_prob"] - logp
    kld = (torch.exp(kl) - kl - 1).clamp(-10.0, 10.0)
    kl_loss = aggregate(kld, mask, loss_agg_mode)
    return pg_loss - entropy_coeff * ent + kl_coef * kl_loss, pg_loss


def critic_step(critic_cfg, local, noise_values: torch.Tensor, full_params) -> dict:
    """A fresh CriticWorker's values of `local`, then one clipped value-loss update on noisy old values."""
    from tinyzero.workers.critic_worker import CriticWorker

    critic = CriticWorker(critic_cfg)
    critic.init_model()
    values = critic.compute_values(local).batch["values"]
    local.batch["values"] = values + noise_values * local.batch["response_mask"]
    return {"values": values, "critic_metrics": critic.update_critic(local).meta_info["metrics"],
            "critic_params": full_params(critic.critic.model)}
