"""On-policy distillation (tinyzero.algorithms.distill, tinyzero.workers.teacher).

- the per-token signal the trainer adds to the advantages, -(log pi_student - log pi_teacher) on the
  sampled tokens, and the "loss" mode's term the actor adds to its loss, equal a float64 reference
  computed from both models' HF logits (atol 1e-5; the workers run fp32, the student FSDP2-sharded
  over 2 gloo ranks, the teacher a larger checkpoint);
- a teacher with another tokenizer is refused before any model loads, in one line;
- train.py runs both modes end to end with a teacher of another size: distill/* and timing_s/teacher
  are logged and finite, and the "loss" mode logs actor/distill_loss.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.workers_helpers import hf_response_log_probs, make_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_ROWS = 8


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A different checkpoint with the student's tokenizer: other seed, wider and deeper."""
    from tinyzero.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("teacher")
    build_tiny_model(str(out), seed=1, hidden_size=96, num_layers=3)
    return str(out)


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory, tiny_model_dir):
    """The student's folder with two tokens' ids swapped in its tokenizer (another vocabulary, same size)."""
    out = str(tmp_path_factory.mktemp("other_vocab") / "model")
    shutil.copytree(tiny_model_dir, out)
    path = os.path.join(out, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(path, "w") as f:
        json.dump(tok, f)
    with open(os.path.join(out, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    return out


def _arr_config(model_dir: str):
    from tinyzero.models.config import ModelConfig
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.workers.config import ActorConfig, ActorRolloutRefConfig, RefConfig

    return ActorRolloutRefConfig(model=ModelConfig(path=model_dir, enable_gradient_checkpointing=False),
                                 actor=ActorConfig(ppo_mini_batch_size=NUM_ROWS),
                                 ref=RefConfig(log_prob_micro_batch_size_per_gpu=3),
                                 rollout=RolloutConfig(n=1, prompt_length=7, response_length=6,
                                                       log_prob_micro_batch_size_per_gpu=3))


def _signal_rank_fn(student_dir: str, teacher_dir: str):
    """On every rank: old_log_probs from the sharded student, teacher_log_prob from the sharded teacher,
    then apply_distillation on the gathered batch (advantages start at 0, reward_weight 0, coef 1)."""
    from tinyzero.algorithms.distill import DistillConfig, apply_distillation
    from tinyzero.distributed import init_distributed
    from tinyzero.protocol import DataProto
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker
    from tinyzero.workers.teacher import TeacherWorker

    init_distributed()
    torch.set_num_threads(1)
    raw = make_batch(NUM_ROWS)
    keys = ["input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask"]
    full = DataProto.from_dict({k: raw[k] for k in keys}, meta_info={"temperature": 1.0})
    arr = _arr_config(student_dir)
    distill = DistillConfig(teacher_path=teacher_dir, teacher_dtype="fp32", coef=1.0, reward_weight=0.0)
    actor = ActorRolloutRefWorker(arr, "actor")
    actor.init_model()
    teacher = TeacherWorker(arr, distill)
    teacher.init_model()
    local = full.chunk(actor.world_size)[actor.rank]
    part = local.union(actor.compute_log_prob(local)).union(teacher.compute_teacher_log_prob(local))
    parts = [None] * actor.world_size
    torch.distributed.all_gather_object(parts, part.select(batch_keys=["old_log_probs", "teacher_log_prob"]))
    full = full.union(DataProto.concat(parts))
    # "loss" mode: one actor update on the zero task advantages; its distill_loss is the k2 term's value.
    local = part.union(DataProto.from_dict({"advantages": torch.zeros_like(part.batch["old_log_probs"])}))
    local.meta_info["distill_loss"] = {"coef": 1.0, "kl_type": "k2"}
    update = actor.update_actor(local).meta_info["metrics"]
    full.batch["advantages"] = torch.zeros_like(full.batch["old_log_probs"])
    metrics = apply_distillation(full, distill) | {"actor/distill_loss": update["actor/distill_loss"],
                                                   "actor/pg_loss": update["actor/pg_loss"]}
    # numpy: the arrays travel back by pickle, not by shared memory the finished rank would take with it
    return {k: full.batch[k].numpy().copy() for k in ("old_log_probs", "teacher_log_prob", "advantages")} \
        | {"metrics": metrics}


@pytest.mark.slow
def test_signal_matches_float64_reference(tiny_model_dir, teacher_dir):
    from transformers import AutoModelForCausalLM

    result = run_distributed(_signal_rank_fn, 2, tiny_model_dir, teacher_dir)[0]
    got = {k: torch.from_numpy(v) if k != "metrics" else v for k, v in result.items()}
    raw = make_batch(NUM_ROWS)
    with torch.no_grad():
        student = hf_response_log_probs(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64), raw)
        teacher = hf_response_log_probs(AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64), raw)
    mask = raw["response_mask"].bool()
    want = -(student - teacher)  # (rows, R): the per-token advantage, coef 1, reward_weight 0
    assert float((student - teacher)[mask].abs().mean()) > 0.05, "the two checkpoints should disagree"
    torch.testing.assert_close(got["old_log_probs"][mask].double(), student[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["teacher_log_prob"][mask].double(), teacher[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["advantages"][mask].double(), want[mask], rtol=0, atol=1e-5)
    assert bool((got["advantages"][~mask] == 0).all()), "padding positions must get no signal"
    m = got["metrics"]
    assert m["distill/reverse_kl"] == pytest.approx(float((student - teacher)[mask].mean()), abs=1e-5)
    assert m["distill/teacher_log_prob"] == pytest.approx(float(teacher[mask].mean()), abs=1e-5)
    assert m["distill/student_log_prob"] == pytest.approx(float(student[mask].mean()), abs=1e-5)
    # "loss" mode's term before the update: token mean of 0.5 (log pi_student - log pi_teacher)^2.
    assert m["actor/distill_loss"] == pytest.approx(float(0.5 * (student - teacher)[mask].square().mean()), abs=1e-5)
    assert m["actor/pg_loss"] == pytest.approx(0.0, abs=1e-7)


def test_apply_distillation_mixes_with_the_task_advantages():
    """advantage = reward_weight * estimator advantage - coef * (student - teacher), on response tokens only."""
    from tinyzero.algorithms.distill import DistillConfig, apply_distillation
    from tinyzero.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    s, t, adv = (torch.randn(2, 4, generator=g) for _ in range(3))
    batch = DataProto.from_dict({"old_log_probs": s, "teacher_log_prob": t, "response_mask": mask,
                                 "advantages": adv.clone()})
    apply_distillation(batch, DistillConfig(teacher_path="x", coef=0.5, reward_weight=2.0))
    want = 2.0 * adv.double() - 0.5 * (s.double() - t.double()) * mask.double()
    torch.testing.assert_close(batch.batch["advantages"].double(), want, rtol=0, atol=1e-6)
    loss_mode = DataProto.from_dict({"old_log_probs": s, "teacher_log_prob": t, "response_mask": mask,
                                     "advantages": adv.clone()})
    metrics = apply_distillation(loss_mode, DistillConfig(teacher_path="x", mode="loss"))
    assert torch.equal(loss_mode.batch["advantages"], adv), "loss mode leaves the advantages alone"
    assert metrics["distill/reverse_kl"] == pytest.approx(float(((s - t) * mask).sum() / mask.sum()), abs=1e-6)


def test_config_checks():
    from tinyzero.algorithms.distill import DistillConfig

    with pytest.raises(ValueError, match="distill.mode"):
        DistillConfig(teacher_path="x", mode="forward")
    with pytest.raises(ValueError, match="distill.reward_weight"):
        DistillConfig(teacher_path="x", mode="loss", reward_weight=0.0)
    with pytest.raises(ValueError, match="distill.loss_kl_type"):
        DistillConfig(teacher_path="x", mode="loss", loss_kl_type="js")
    assert not DistillConfig().enabled


def test_other_tokenizer_refused(tiny_model_dir, other_vocab_dir, teacher_dir):
    from tinyzero.algorithms.distill import DistillConfig
    from tinyzero.models.config import ModelConfig
    from tinyzero.workers.teacher import check_teacher_vocabulary

    student = ModelConfig(path=tiny_model_dir)
    with pytest.raises(ValueError, match="tokenizer differs from the student's") as e:
        check_teacher_vocabulary(student, DistillConfig(teacher_path=other_vocab_dir))
    assert "\n" not in str(e.value) and "4 (token, id) pairs differ" in str(e.value)
    check_teacher_vocabulary(student, DistillConfig(teacher_path=teacher_dir))  # same tokenizer: accepted


# --------------------------------------------------------------------------- end to end through train.py

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def _train(root, model_dir: str, teacher: str, run: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), "--preset", "demo_cpu", f"--data.train_files={root}/data/train.parquet",
           f"--data.val_files={root}/data/test.parquet", f"--actor_rollout_ref.model.path={model_dir}",
           f"--trainer.default_local_dir={root}/{run}", "--trainer.plot=false", "--trainer.total_training_steps=2",
           "--trainer.val_before_train=false", f"--distill.teacher_path={teacher}", *extra]
    return subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    from tinyzero.demo import build_data

    root = tmp_path_factory.mktemp("distill_e2e")
    build_data(str(root / "data"))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["advantage", "loss"])
def test_train_py_distills(demo_data, tiny_model_dir, teacher_dir, mode):
    from tinyzero.trainer.loggers import read_metrics

    extra = ["--distill.reward_weight=0.5"] if mode == "advantage" else ["--distill.coef=0.1"]
    out = _train(demo_data, tiny_model_dir, teacher_dir, mode, f"--distill.mode={mode}", *extra)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    steps = [r for r in read_metrics(str(demo_data / mode)) if "actor/pg_loss" in r]
    assert len(steps) == 2
    names = ["distill/reverse_kl", "distill/teacher_log_prob", "distill/student_log_prob", "timing_s/teacher"]
    names += ["actor/distill_loss"] if mode == "loss" else ["distill/advantage_mean"]
    for row in steps:
        for name in names:
            assert name in row and math.isfinite(row[name]), (name, row.get(name))
        assert row["distill/teacher_log_prob"] < 0 and row["distill/student_log_prob"] < 0
        assert row["timing_s/teacher"] > 0


@pytest.mark.slow
def test_train_py_teacher_on_the_split_pool(demo_data, tiny_model_dir, teacher_dir):
    """pipeline.placement=split with distill.teacher_pool=split: the actor on rank 0, the teacher alone on
    rank 1 (plan.yaml says so); the signal reaches the advantages as on the policy pool."""
    import yaml

    from tinyzero.trainer.loggers import read_metrics

    out = _train(demo_data, tiny_model_dir, teacher_dir, "split", "--pipeline.placement=split",
                 "--pipeline.actor_pool_size=1", "--distill.teacher_pool=split", "--distill.reward_weight=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    with open(demo_data / "split" / "plan.yaml") as f:
        pools = yaml.safe_load(f)["pools"]
    assert pools["actor"] == [0] and pools["teacher"] == [1], pools
    steps = [r for r in read_metrics(str(demo_data / "split")) if "actor/pg_loss" in r]
    assert len(steps) == 2
    for row in steps:
        for name in ("distill/reverse_kl", "distill/teacher_log_prob", "distill/advantage_mean", "timing_s/teacher"):
            assert name in row and math.isfinite(row[name]), (name, row.get(name))
        assert row["distill/teacher_log_prob"] < 0


@pytest.mark.slow
def test_train_py_refuses_other_tokenizer(demo_data, tiny_model_dir, other_vocab_dir):
    out = _train(demo_data, tiny_model_dir, other_vocab_dir, "refused")
    assert out.returncode != 0
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "tokenizer differs from the student's" in ln]
    assert len(lines) == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "error: distill.teacher_path=" in lines[0]
    # torchrun prints its launcher's traceback; none of tinyzero's frames may show.
    assert "/tinyzero/" not in "".join(ln for ln in out.stderr.splitlines() if ln.strip().startswith("File "))
