"""On-policy distillation: a frozen teacher's log-probs on the student's own samples as a dense signal.

The student samples responses; the teacher (a frozen causal LM with the student's vocabulary,
tinyzero.workers.teacher) scores the sampled tokens; the per-token reverse KL estimate on them,

    kl_t = log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)      # (rows, R), k1 on the samples

is the signal. Its expectation over the student's samples is KL(pi_student || pi_teacher) per token.
Two ways to train on it (`distill.mode`):
- "advantage" (Thinking Machines / Tinker on-policy distillation): the per-token advantage
  -coef * kl_t is added to the estimator's advantages times `reward_weight` (0: distillation alone);
- "loss" (veRL's / TRL's form): coef * kl_penalty(log pi_student, log pi_teacher, loss_kl_type) is
  added to the actor's loss beside the task reward's policy-gradient loss (the use_kl_loss term with
  the teacher in the reference's place; "k2" is the estimator whose on-policy gradient is reverse KL's).

    cfg.distill = DistillConfig(teacher_path="/models/teacher", coef=1.0, mode="advantage")
    # the trainer: teacher_log_prob from the teacher role, then after compute_advantage:
    metrics = apply_distillation(batch, cfg.distill)

Metrics: distill/reverse_kl, distill/teacher_log_prob, distill/student_log_prob (token means over the
batch's response tokens); the trainer times the teacher pass as timing_s/teacher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .functional import masked_mean
from .kl import KL_ESTIMATORS

DISTILL_MODES = ("advantage", "loss")


@dataclass
class DistillConfig:
    """On-policy distillation from a frozen teacher (`distill`); off while `teacher_path` is empty."""

    teacher_path: str = ""
    """Local folder of the teacher (HF causal LM). It must share the student's tokenizer; it may be larger.
    Empty: no distillation."""
    teacher_tokenizer_path: str = ""
    """Folder of the teacher's tokenizer (compared with the student's at start-up); empty: teacher_path."""
    teacher_dtype: str = "auto"
    """Dtype the teacher's weights are held in ("auto": the compute dtype of actor_rollout_ref.ref's FSDP
    mixed precision, bf16 on GPU; or "fp32", "bf16", "fp16", "fp64"). The teacher is sharded with
    actor_rollout_ref.ref.fsdp_config and batched with actor_rollout_ref.ref's log-prob settings."""
    teacher_pool: Literal["policy", "split"] = "policy"
    """Where the teacher runs. "policy": on the policy pool's ranks, beside the actor (colocated, like the
    reference model). "split": on the second pool of pipeline.placement=split, beside the critic and the
    reward model, so a larger teacher's memory stays off the policy ranks and its log-probs are computed
    while the policy pool computes its own."""
    mode: Literal["advantage", "loss"] = "advantage"
    """"advantage": -coef * (log pi_student - log pi_teacher) per token, added to the advantages (Tinker's
    recipe); "loss": coef * KL(student || teacher) estimate in the actor loss (veRL's / TRL's form)."""
    coef: float = 1.0
    """Weight of the distillation signal (per-token advantage scale, or the loss term's coefficient)."""
    reward_weight: float = 1.0
    """"advantage" mode: the task reward's advantages are scaled by this before the distillation term is
    added (0: pure distillation, the rule reward only logged). "loss" mode: must stay 1.0 (the policy
    loss of the task reward is unchanged; set coef instead)."""
    loss_kl_type: str = "k2"
    """"loss" mode: the KL estimator on the sampled tokens (tinyzero.algorithms.kl). "k2" (0.5 * log-ratio^2)
    has the on-policy gradient of the reverse KL; "low_var_kl" / "k3" is veRL's kl_loss default."""

    def __post_init__(self):
        if self.mode not in DISTILL_MODES:
            raise ValueError(f"distill.mode={self.mode!r} is unknown; use one of {list(DISTILL_MODES)}")
        if not self.coef >= 0:
            raise ValueError(f"distill.coef must be >= 0 (got {self.coef})")
        if not self.reward_weight >= 0:
            raise ValueError(f"distill.reward_weight must be >= 0 (got {self.reward_weight})")
        if self.mode == "loss" and self.reward_weight != 1.0:
            raise ValueError(f"distill.reward_weight={self.reward_weight} applies to mode=advantage; with "
                             "mode=loss weigh the teacher by distill.coef and leave reward_weight=1.0")
        if self.loss_kl_type.rstrip("+") not in KL_ESTIMATORS:
            raise ValueError(f"distill.loss_kl_type={self.loss_kl_type!r} is unknown; use one of "
                             f"{list(KL_ESTIMATORS)} (optionally with '+')")

    @property
    def enabled(self) -> bool:
        """Whether the run distills (a teacher is named)."""
        return bool(self.teacher_path)


def reverse_kl(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor) -> torch.Tensor:
    """kl_t = log pi_student(y_t) - log pi_teacher(y_t) on the sampled tokens; (rows, R) -> (rows, R)."""
    return student_log_prob - teacher_log_prob


def distill_metrics(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor,
                    response_mask: torch.Tensor) -> dict[str, float]:
    """distill/* token means over the response tokens."""
    mask = response_mask.float()  # (rows, R)
    kl = reverse_kl(student_log_prob, teacher_log_prob)  # (rows, R)
    return {"distill/reverse_kl": float(masked_mean(kl, mask)),
            "distill/teacher_log_prob": float(masked_mean(teacher_log_prob, mask)),
            "distill/student_log_prob": float(masked_mean(student_log_prob, mask))}


def apply_distillation(batch, config: DistillConfig) -> dict[str, float]:
    """After the estimator: the metrics, and in "advantage" mode the advantages rewritten in place as
    reward_weight * advantages - coef * kl_t on the response tokens. Reads `old_log_probs` (the student
    that sampled), `teacher_log_prob`, `response_mask`, `advantages` from `batch.batch`."""
    b = batch.batch
    for key in ("old_log_probs", "teacher_log_prob", "response_mask", "advantages"):
        if key not in b:
            raise ValueError(f"distillation: the batch lacks {key!r} (the trainer computes old_log_probs and "
                             "teacher_log_prob whenever distill.teacher_path is set)")
    mask = b["response_mask"].float()  # (rows, R)
    student, teacher = b["old_log_probs"].float(), b["teacher_log_prob"].float()  # (rows, R)
    metrics = distill_metrics(student, teacher, mask)
    if config.mode == "advantage":
        signal = -config.coef * reverse_kl(student, teacher) * mask  # (rows, R)
        b["advantages"] = config.reward_weight * b["advantages"] + signal.to(b["advantages"].dtype)
        metrics["distill/advantage_mean"] = float(masked_mean(signal, mask))
    return metrics

