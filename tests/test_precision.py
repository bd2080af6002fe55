"""The training precision policy: fp32 master weights and AdamW state for every trainable role, bf16
compute on CUDA, decided in tinyzero.models.precision.

CUDA is faked (torch.cuda.is_available and is_bf16_supported patched to True) after the CPU process
group is up, so the load path decides dtypes exactly as it would on a GPU while the tensors live on
CPU. The live test goes through the production loader (load_sharded_model) and optimizer
(build_optimizer) on the offline tiny model, and checks parameter, gradient and Adam-state dtypes
after a real step at an RL learning rate, plus that the step moved the weights (a bf16 master copy
rounds most such updates away). That bf16 compute kernels are used on a real GPU is checked by
scripts/gpu_check.py only.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def _fake_cuda(monkeypatch=None):
    """torch.cuda.is_available() and is_bf16_supported() report a bf16-capable GPU."""
    if monkeypatch is not None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    else:  # inside a spawned rank: patched for the rest of that process
        torch.cuda.is_available = lambda: True
        torch.cuda.is_bf16_supported = lambda *a, **k: True


def live_rank_fn(model_dir: str, model_dtype: str) -> dict:
    """Load the tiny actor as on a GPU host, take one AdamW step at lr 1e-6, report dtypes."""
    from torch.distributed.device_mesh import init_device_mesh

    from tinyzero.distributed import init_distributed, set_seed
    from tinyzero.models.config import FSDPConfig, MixedPrecisionConfig, ModelConfig
    from tinyzero.models.fsdp import load_sharded_model
    from tinyzero.workers.config import OptimConfig
    from tinyzero.workers.optim import build_optimizer

    init_distributed()
    torch.set_num_threads(1)
    set_seed(0)
    _fake_cuda()
    assert torch.cuda.is_available()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    # bf16 compute, which "auto" resolves to on CUDA; the mesh stays on CPU.
    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="bf16", reduce_dtype="fp32"))
    model_cfg = ModelConfig(path=model_dir, dtype=model_dtype, enable_gradient_checkpointing=False)
    model = load_sharded_model(model_cfg, fsdp, mesh, kind="causal_lm")
    optim = build_optimizer(model.parameters(), OptimConfig(lr=1e-6, weight_decay=0.0))
    before = {n: p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
              for n, p in model.named_parameters()}
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids).logits
    loss = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    grad_dtypes = {n: p.grad.dtype for n, p in model.named_parameters() if p.grad is not None}
    optim.step()
    state_dtypes = {f"{n}.{k}": v.dtype for n, p in model.named_parameters()
                    for k, v in optim.state[p].items() if k in ("exp_avg", "exp_avg_sq")}
    moved, total = 0, 0
    for n, p in model.named_parameters():
        after = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        moved += int((after != before[n]).sum())
        total += after.numel()
    return {"param": {n: p.dtype for n, p in model.named_parameters()}, "grad": grad_dtypes, "state": state_dtypes,
            "logits": logits.dtype, "moved_frac": moved / total}


@pytest.mark.slow
@pytest.mark.parametrize("model_dtype", ["auto", "fp32"])
def test_trainable_model_keeps_fp32_master_weights_and_adam_state(tiny_model_dir, model_dtype):
    res = run_distributed(live_rank_fn, 1, tiny_model_dir, model_dtype, timeout=240)[0]
    assert set(res["param"].values()) == {torch.float32}, res["param"]
    assert res["grad"] and set(res["grad"].values()) == {torch.float32}, res["grad"]
    assert res["state"] and set(res["state"].values()) == {torch.float32}, res["state"]
    assert res["logits"] == torch.bfloat16  # compute ran in bf16
    # Adam's first step moves every weight with a gradient by about lr; in bf16 most such moves of
    # weights of size ~0.02 are below half a unit in the last place and would round away.
    assert res["moved_frac"] > 0.9, res["moved_frac"]


def test_policy_as_on_cuda(monkeypatch):
    from tinyzero.models.config import FSDPConfig, MixedPrecisionConfig, ModelConfig
    from tinyzero.models.precision import resolve_precision

    _fake_cuda(monkeypatch)
    fsdp = FSDPConfig()
    for name in ("auto", "fp32", "float32"):
        p = resolve_precision(ModelConfig(path="x", dtype=name), fsdp, "cuda", trainable=True)
        assert (p.master_dtype, p.optim_state_dtype, p.compute_dtype, p.reduce_dtype) == (
            torch.float32, torch.float32, torch.bfloat16, torch.float32), (name, p)
    # A frozen role (reference, teacher, reward model) may keep its weights in the compute dtype.
    frozen = resolve_precision(ModelConfig(path="x", dtype="auto"), fsdp, "cuda", trainable=False)
    assert frozen.master_dtype == torch.bfloat16 and frozen.compute_dtype == torch.bfloat16
    # fp64 reference runs keep fp64.
    f64 = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp64", reduce_dtype="fp64"))
    p = resolve_precision(ModelConfig(path="x", dtype="fp64"), f64, "cpu", trainable=True)
    assert p.master_dtype == p.compute_dtype == torch.float64
    # Half-precision master weights for a trainable role are refused with the fix in the message.
    for name in ("bf16", "fp16"):
        with pytest.raises(ValueError, match="model.dtype=fp32"):
            resolve_precision(ModelConfig(path="x", dtype=name), fsdp, "cuda", trainable=True)
    # With LoRA the base weights are frozen: they may be bf16; the adapters are fp32 (models.lora).
    lora = resolve_precision(ModelConfig(path="x", dtype="bf16", lora_rank=4), fsdp, "cuda", trainable=True)
    assert lora.master_dtype == torch.bfloat16 and lora.adapter_dtype == torch.float32


def test_policy_same_on_cpu_but_compute(monkeypatch):
    """CPU and CUDA differ in the compute dtype only."""
    from tinyzero.models.config import FSDPConfig, ModelConfig
    from tinyzero.models.precision import resolve_precision

    cfg, fsdp = ModelConfig(path="x", dtype="auto"), FSDPConfig()
    cpu = resolve_precision(cfg, fsdp, "cpu", trainable=True)
    _fake_cuda(monkeypatch)
    gpu = resolve_precision(cfg, fsdp, "cuda", trainable=True)
    assert cpu.compute_dtype == torch.float32 and gpu.compute_dtype == torch.bfloat16
    assert (cpu.master_dtype, cpu.optim_state_dtype, cpu.reduce_dtype) == (
        gpu.master_dtype, gpu.optim_state_dtype, gpu.reduce_dtype) == (torch.float32,) * 3


def test_presets_train_in_fp32_master_weights(monkeypatch):
    """Every preset's trainable roles (actor, critic), resolved as on CUDA, hold fp32 master weights."""
    from tinyzero.configs import PRESETS

    from tinyzero.models.precision import resolve_precision

    _fake_cuda(monkeypatch)
    for name, preset in PRESETS.items():
        cfg = preset()
        arr = cfg.actor_rollout_ref
        actor = resolve_precision(arr.model, arr.actor.fsdp_config, "cuda", trainable=True)
        trained = actor.adapter_dtype if arr.model.lora_rank else actor.master_dtype
        assert trained == actor.optim_state_dtype == torch.float32, name
        assert actor.compute_dtype == torch.bfloat16 or arr.actor.fsdp_config.mixed_precision.param_dtype != "auto"
        if cfg.critic.model.path:
            critic = resolve_precision(cfg.critic.model, cfg.critic.fsdp_config, "cuda", trainable=True)
            assert critic.master_dtype == critic.optim_state_dtype == torch.float32, name
