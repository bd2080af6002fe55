"""TeacherWorker: a frozen causal LM that scores the student's sampled tokens (on-policy distillation).

    check_teacher_vocabulary(student_model_config, distill)      # start-up, on every rank: one vocabulary
    wg = WorkerGroup(resource_pool=pool,
                     cls_with_init=ClassWithInitArgs(TeacherWorker, cfg.actor_rollout_ref, cfg.distill, dims=dims))
    wg.init_model()
    batch = batch.union(wg.compute_teacher_log_prob(batch))      # teacher_log_prob (rows, R)

The teacher is the reference model's twin with its own weights: loaded from `distill.teacher_path` in
`distill.teacher_dtype`, sharded with `actor_rollout_ref.ref.fsdp_config` over the reference's layout,
batched by the reference's log-prob settings and run at the rollout's temperature, so its log-probs
are computed exactly as ref_log_prob is (tinyzero.workers.actor_worker.compute_ref_log_prob).
"""

from __future__ import annotations

import dataclasses

from tinyzero.algorithms.distill import DistillConfig
from tinyzero.distributed.parallel_dims import ParallelDims
from tinyzero.protocol import DataProto
from tinyzero.single_controller import Dispatch, Worker, register
from tinyzero.workers.actor import PPOActor
from tinyzero.workers.common import offload_after_init, on_device, prepare_role_model
from tinyzero.workers.config import ActorRolloutRefConfig, role_layout
from tinyzero.workers.packing import packing_mode


def teacher_model_config(model_config, distill: DistillConfig):
    """The student's model settings with the teacher's folder and dtype (no LoRA, no recompute: frozen)."""
    return dataclasses.replace(model_config, path=distill.teacher_path,
                               tokenizer_path=distill.teacher_tokenizer_path or distill.teacher_path,
                               dtype=distill.teacher_dtype, lora_rank=0, enable_gradient_checkpointing=False,
                               override_config={})


def check_teacher_vocabulary(model_config, distill: DistillConfig) -> None:
    """Token-level distillation needs one vocabulary: the teacher's tokenizer must map every token to the
    student's id, and the teacher's output layer must cover the student's ids. Raises ValueError (one line)."""
    from tinyzero.models.loading import load_hf_config, load_tokenizer

    teacher = teacher_model_config(model_config, distill)
    student_tok = load_tokenizer(model_config.resolved_tokenizer_path, model_config.trust_remote_code)
    teacher_tok = load_tokenizer(teacher.resolved_tokenizer_path, teacher.trust_remote_code)
    s_vocab, t_vocab = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s_vocab != t_vocab:
        differ = sorted(set(s_vocab.items()) ^ set(t_vocab.items()), key=lambda kv: kv[1])
        example = f"; e.g. token {differ[0][0]!r}" if differ else ""
        raise ValueError(f"distill.teacher_path={distill.teacher_path!r}: the teacher's tokenizer differs from the "
                         f"student's ({len(t_vocab)} vs {len(s_vocab)} tokens, {len(differ)} (token, id) pairs "
                         f"differ{example}); token-level distillation needs one vocabulary: choose a teacher of "
                         "the student's model family (same tokenizer)")
    s_size = load_hf_config(model_config.path, model_config.trust_remote_code).vocab_size
    t_size = load_hf_config(teacher.path, teacher.trust_remote_code).vocab_size
    if t_size < len(s_vocab) or s_size < len(s_vocab):
        raise ValueError(f"distill.teacher_path={distill.teacher_path!r}: the teacher's vocab_size={t_size} (student "
                         f"{s_size}) does not cover the tokenizer's {len(s_vocab)} tokens; token-level distillation "
                         "needs a teacher whose output layer scores every student token")


class TeacherWorker(Worker):
    """Frozen teacher log-probs on the student's samples (the reference pass with the teacher's weights)."""

    def __init__(self, config: ActorRolloutRefConfig, distill: DistillConfig, dims: ParallelDims | None = None):
        """`config` is the policy's section (its ref settings shard and batch the teacher); `dims` comes from
        the run plan (a worker built outside a run lays the teacher out like the reference on its pool)."""
        super().__init__()
        if not distill.enabled:
            raise ValueError("TeacherWorker needs distill.teacher_path (the teacher's model folder)")
        self.config = config
        self.distill = distill
        self.dims = role_layout(config.ref, self.world_size) if dims is None else dims
        self._register_dispatch_collect_info("teacher", self.dims.dp_rank(self.rank), self.dims.is_collect(self.rank))
        self.teacher: PPOActor | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        """Load the teacher sharded over the pool like the reference model, frozen."""
        cfg = self.config
        model_config = teacher_model_config(cfg.model, self.distill)
        fsdp = cfg.ref.fsdp_config
        model = prepare_role_model(self, model_config, fsdp, self.dims, "causal_lm", trainable=False,
                                   packing=packing_mode(model_config))
        self.teacher = PPOActor(cfg.actor, model, dp_group=self.dims.dp_group(self.device_mesh, self.process_group),
                                dp_size=self.dims.fsdp_size, device=self.device, packing=packing_mode(model_config))
        offload_after_init(model, fsdp)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="teacher")
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """teacher_log_prob (rows, R): the teacher's log-probs of the sampled response tokens."""
        ref = self.config.ref
        temperature = float(data.meta_info.get("temperature", getattr(self.config.rollout, "temperature", 1.0)))
        with on_device(self.teacher.model, ref.fsdp_config, self.device):
            log_probs, _ = self.teacher.compute_log_prob(data, ref.log_prob_micro_batch_size_per_gpu,
                                                         ref.log_prob_use_dynamic_bsz,
                                                         ref.log_prob_max_token_len_per_gpu, temperature, False)
        return DataProto.from_dict(tensors={"teacher_log_prob": log_probs}, meta_info={"temperature": temperature})
