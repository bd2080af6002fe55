"""One PPO step through the real workers at tensor / sequence-parallel layouts against one rank, float64.

One spawn of 4 gloo ranks runs every layout in turn, each with fresh WorkerGroups (actor, ref and
critic on all 4 ranks, each dispatched by its own mesh): the actor at tp=2 x dp=2, sp=2 x dp=2 and
tp=2 x sp=2, plain (every role at the actor's layout) and packed (use_remove_padding, token-budget
micro-batches, the ref and critic at other layouts on the same ranks, e.g. the critic at dp=4 beside
a tp=2 x sp=2 actor, and the tp=2 actor over 2 replicas: HSDP x TP). The reference is the same step on a pool of rank 0 alone (tp=1, sp=1).
Everything runs in float64 (model dtype and FSDP2 compute / reduce dtypes), so only the summation
order differs: old / ref log-probs and values (under the response mask), the actor's and critic's
losses and grad norms, and every parameter after the step must agree to TOL. Measured: parameters
within 8.3e-16 (actor) and 3.8e-16 (critic) at every layout, log-probs, entropies and values
bit-identical. Adam's first step is nearly g / |g|, so a gradient-scale error (a token count or loss
factor off by tp or sp) barely moves the parameters (1e-10 when token counts included the tp peers);
the reported grad norms, held to the same tolerance, catch it (they halve).

The same run checks:
- memory: per rank, parameter, gradient (at the optimizer step) and optimizer-state bytes equal a
  count from the model's parameter shapes and the tensor-parallel plan (vocabulary / column /
  row-sharded matrices 1/tp, norms and the value head replicated over tp, then dim 0 split by
  torch.chunk over dp_shard);
- weight sync: the tensors the native engine receives from the tp=2 x dp_replicate=2 actor are the
  full parameters, and greedy generation from them equals greedy generation from the tp=1 actor;
- checkpoints: saved at tp=2 x dp_replicate=2, loaded at tp=1 (dp=4) and saved again, loaded back at
  tp=2 x dp_shard=2: the parameters and AdamW state equal the saved ones bit for bit; the HF export
  from tp=2 holds plain
  full tensors that load with transformers and equal the parameters.

Runtime: one 4-rank spawn, ~140 s on 2 loaded cores (slow).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_workers_actor import _full_params, _portable, _torch
from tests.workers_helpers import make_batch

pytestmark = pytest.mark.slow

NUM_ROWS = 8
MAX_TOKENS = 30  # token budget of a packed micro-batch (rows hold 3..13 tokens)
# float64 throughout, so only the summation order differs between layouts. Log-probs and values leave
# the workers as float32 (their contract), so a one-ulp rounding flip there is possible; measured:
# parameters within 8.3e-16, log-probs and values bit-identical under the response mask.
TOL = dict(atol=1e-9, rtol=1e-7)
EXACT_METRICS = ("loss", "grad_norm", "kl", "entropy", "/lr")  # float64 sums: held to TOL
# Clip fractions and vpred_mean are float32 statistics (the response mask's float32 counts, values in
# float32) summed per micro-batch, and packed runs split micro-batches by tokens: float32 rounding.
FP32_STAT_RTOL = 1e-6
LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # the actor's (tp, sp) on 4 ranks: dp = 4 / (tp x sp)
# (ref layout, critic layout, actor fsdp_size) per actor layout: plain runs give every role the actor's
# layout; packed runs put the roles on different meshes over the same ranks (e.g. the critic at dp=4
# beside a tp=2 x sp=2 actor), and the tp=2 actor replicates over 2 copies instead of sharding (HSDP
# x TP: dp_replicate=2, dp_shard=1); that run also checks weight sync and checkpoints.
PACKED_ROLES = {(2, 1): ((2, 1), (1, 2), 1), (1, 2): ((2, 1), (2, 1), -1), (2, 2): ((1, 1), (1, 1), -1)}
EXTRAS = (2, 1, True)


def _configs(model_dir: str, tp: int, sp: int, packed: bool, ref_layout=None, critic_layout=None,
             actor_fsdp_size: int = -1):
    from tinyzero.models.config import FSDPConfig, MixedPrecisionConfig, ModelConfig
    from tinyzero.rollout.config import RolloutConfig
    from tinyzero.workers.config import (
        ActorConfig,
        ActorRolloutRefConfig,
        CriticConfig,
        OptimConfig,
        RefConfig,
    )

    def fsdp(size: int = -1):
        return FSDPConfig(fsdp_size=size, mixed_precision=MixedPrecisionConfig(param_dtype="fp64", reduce_dtype="fp64"))

    def model(checkpointing: bool):
        return ModelConfig(path=model_dir, dtype="fp64", use_remove_padding=packed,
                           enable_gradient_checkpointing=checkpointing)

    def dims(layout):
        return dict(tensor_model_parallel_size=layout[0], ulysses_sequence_parallel_size=layout[1])

    layout = dims((tp, sp))
    # Packed runs also take token-budget micro-batches (several per rank), the plain ones fixed row counts.
    micro = dict(use_dynamic_bsz=packed, ppo_max_token_len_per_gpu=MAX_TOKENS, ppo_micro_batch_size_per_gpu=2)
    optim = OptimConfig(lr=1e-3, weight_decay=0.01, eps=1e-6)
    actor = ActorConfig(ppo_mini_batch_size=NUM_ROWS, grad_clip=1.0, **micro,
                        entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                        clip_ratio_low=0.2, clip_ratio_high=0.28, optim=optim, fsdp_config=fsdp(actor_fsdp_size),
                        **layout)
    arr = ActorRolloutRefConfig(model=model(True), actor=actor,
                                ref=RefConfig(log_prob_micro_batch_size_per_gpu=3, fsdp_config=fsdp(),
                                              **dims(ref_layout or (tp, sp))),
                                rollout=RolloutConfig(n=1, prompt_length=7, response_length=6, do_sample=False,
                                                      log_prob_micro_batch_size_per_gpu=3))
    critic = CriticConfig(model=model(False), optim=OptimConfig(lr=1e-3, eps=1e-6), ppo_mini_batch_size=NUM_ROWS,
                          grad_clip=1.0, **micro, cliprange_value=0.2, fsdp_config=fsdp(),
                          **dims(critic_layout or (tp, sp)))
    return arr, critic


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().cpu()


def _full_optim_state(optimizer) -> dict[str, torch.Tensor]:
    """exp_avg / exp_avg_sq / step of every parameter, gathered, keyed by parameter index."""
    out = {}
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        for key, value in optimizer.state[p].items():
            out[f"{i}.{key}"] = _full(value)
    return out


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def _chunk_len(n: int, parts: int, i: int) -> int:
    """Length of torch.chunk(range(n), parts)[i] (DTensor's uneven Shard split)."""
    c = -(-n // parts)
    return max(0, min(c, n - i * c))


def _tp_dim(name: str) -> int | None:
    """The plan (tinyzero.models.tensor_parallel): the tensor dimension a parameter is split along over tp."""
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")):
        return 0  # column-parallel (weight and bias) and vocabulary-parallel
    if any(k in name for k in ("o_proj", "down_proj")):
        return 1 if name.endswith("weight") else None  # row-parallel weight; a bias would be replicated
    return None  # norms and scalar heads: replicated over tp


def _expected_local_numel(shapes: dict[str, tuple], tp: int, t: int, dp_shard: int, d: int) -> int:
    total = 0
    for name, shape in shapes.items():
        shape = list(shape)
        dim = _tp_dim(name)
        if tp > 1 and dim is not None:
            shape[dim] = _chunk_len(shape[dim], tp, t)
        shape[0] = _chunk_len(shape[0], dp_shard, d)  # FSDP2 Shard(0) of the tensor-parallel piece
        total += int(torch.Size(shape).numel())
    return total


def _prompts():
    """4 left-padded prompts of different lengths (one per rank at rollout tp=1)."""
    from tinyzero.protocol import DataProto

    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(4, 7, dtype=torch.long)
    mask = torch.zeros(4, 7, dtype=torch.long)
    for i, n in enumerate([7, 3, 5, 2]):
        ids[i, 7 - n:] = torch.randint(3, 250, (n,), generator=g)
        mask[i, 7 - n:] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               meta_info={"do_sample": False})


def _memory_probe(trained, shapes, dims, rank):
    """Per-rank bytes of parameters, of gradients at the optimizer step, and of optimizer state,
    with the counts the plan predicts."""
    seen = {}
    params = trained.optimizer_params()

    def at_step(optimizer, args, kwargs):
        seen["grad"] = _local_bytes([p.grad for p in params if p.grad is not None])

    handle = trained.optimizer.register_step_pre_hook(at_step)
    _, d, _, t = dims.coordinates(rank)
    item = params[0].element_size()

    def report():
        handle.remove()
        state = [v for p in params for v in trained.optimizer.state[p].values() if v.ndim > 0]
        return {"param": _local_bytes(params), "grad": seen.get("grad"), "optim": _local_bytes(state),
                "expected": _expected_local_numel(shapes, dims.tp, t, dims.dp_shard, d) * item,
                "tp": dims.tp, "dp_shard": dims.dp_shard,
                "full": sum(int(torch.Size(s).numel()) for s in shapes.values()) * item}
    return report


def _step(model_dir: str, tp: int, sp: int, packed: bool, ranks: list[int], extras: bool, roles=(None, None, -1)):
    """One PPO step (log-probs, ref, values, critic update, actor update) on a pool of `ranks`."""
    import torch.distributed as dist

    from tinyzero.distributed import set_seed
    from tinyzero.protocol import DataProto
    from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup, materialize
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker
    from tinyzero.workers.critic_worker import CriticWorker

    set_seed(0)
    arr_cfg, critic_cfg = _configs(model_dir, tp, sp, packed, *roles)
    pool = ResourcePool(ranks=ranks)
    actor = WorkerGroup(pool, ClassWithInitArgs(ActorRolloutRefWorker, arr_cfg, "actor_rollout"))
    ref = WorkerGroup(pool, ClassWithInitArgs(ActorRolloutRefWorker, arr_cfg, "ref"))
    critic = WorkerGroup(pool, ClassWithInitArgs(CriticWorker, critic_cfg))
    for wg in (actor, ref, critic):
        materialize(wg.init_model())
    raw = make_batch(NUM_ROWS)
    keys = ["input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask", "advantages",
            "returns"]
    data = DataProto.from_dict({k: raw[k] for k in keys}, meta_info={"temperature": 1.0})
    out = {"layout": (tp, sp, packed), "roles": roles, "extras": extras}
    probes = {}
    if actor.is_local:
        w = actor.worker
        shapes = {n: tuple(p.shape) for n, p in w.actor.model.named_parameters()}
        probes["actor"] = _memory_probe(w.actor, shapes, w.dims["actor"], w.rank)
        c = critic.worker
        shapes = {n: tuple(p.shape) for n, p in c.critic.model.named_parameters()}
        probes["critic"] = _memory_probe(c.critic, shapes, c.dims, c.rank)
    old = actor.compute_log_prob(data)
    ref_lp = ref.compute_ref_log_prob(data)
    values = critic.compute_values(data)
    mask = data.batch["response_mask"]
    out.update(old_log_probs=old.batch["old_log_probs"], entropys=old.batch["entropys"],
               ref_log_prob=ref_lp.batch["ref_log_prob"], values=values.batch["values"])
    data.batch["old_log_probs"] = old.batch["old_log_probs"] + raw["noise_old"].double()
    data.batch["ref_log_prob"] = ref_lp.batch["ref_log_prob"] + raw["noise_ref"].double()
    data.batch["values"] = values.batch["values"] + raw["noise_values"].double() * mask
    out["critic_metrics"] = critic.update_critic(data).meta_info["metrics"]
    out["actor_metrics"] = actor.update_actor(data).meta_info["metrics"]
    if actor.is_local:
        out["memory"] = {role: probe() for role, probe in probes.items()}
        out["actor_params"] = _full_params(actor.worker.actor.model)
        out["critic_params"] = _full_params(critic.worker.critic.model)
    if extras:
        out.update(_sync_and_generate(actor))
    dist.barrier()
    return out, actor


def _sync_and_generate(actor):
    """Greedy generation after the step; the tensors the engine received from the weight sync."""
    from tinyzero.single_controller import materialize

    synced = {}
    if actor.is_local:
        rollout = actor.worker.rollout
        engine_update = rollout.update_weights

        def capture(tensors):
            tensors = list(tensors)
            synced.update({name: t.detach().clone().cpu() for name, t in tensors})
            return engine_update(iter(tensors))

        rollout.update_weights = capture
    gen = materialize(actor.generate_sequences(_prompts()))
    metrics = {k: v for k, v in gen.meta_info.get("metrics", {}).items() if "sync" in k or "rollout" in k}
    return {"synced": synced, "responses": gen.batch["responses"], "sync_metrics": metrics}


def _checkpoints(model_dir: str, actor_tp2, ckpt_dir: str, export_dir: str):
    """Save at tp=2, load at tp=1 (save again), load back at tp=2; export HF from tp=2."""
    from tinyzero.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup, materialize
    from tinyzero.workers.actor_worker import ActorRolloutRefWorker

    w = actor_tp2.worker
    saved = {"params": _full_params(w.actor.model), "optim": _full_optim_state(w.actor.optimizer)}
    materialize(actor_tp2.save_checkpoint(os.path.join(ckpt_dir, "tp2"), 1))
    materialize(actor_tp2.export_hf(export_dir))
    out = {"saved": saved}
    for name, tp, src in (("tp1", 1, "tp2"), ("tp2_again", 2, "tp1")):
        cfg, _ = _configs(model_dir, tp, 1, False)
        wg = WorkerGroup(ResourcePool(ranks=[0, 1, 2, 3]), ClassWithInitArgs(ActorRolloutRefWorker, cfg, "actor"))
        materialize(wg.init_model())
        materialize(wg.load_checkpoint(os.path.join(ckpt_dir, src)))
        if name == "tp1":
            materialize(wg.save_checkpoint(os.path.join(ckpt_dir, "tp1"), 1))
        fresh = wg.worker.actor
        out[name] = {"params": _full_params(fresh.model), "optim": _full_optim_state(fresh.optimizer),
                     "tp": wg.worker.dims["actor"].tp}
    return out


def parallel_ppo_rank_fn(model_dir: str, ckpt_dir: str, export_dir: str):
    from tinyzero.distributed import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = []
    ref_out, _ = _step(model_dir, 1, 1, False, [0], extras=True)
    results.append(ref_out)
    ckpt = None
    for tp, sp in LAYOUTS:
        for packed in (False, True):
            extras = (tp, sp, packed) == EXTRAS
            roles = PACKED_ROLES[(tp, sp)] if packed else (None, None, -1)
            out, actor = _step(model_dir, tp, sp, packed, [0, 1, 2, 3], extras=extras, roles=roles)
            results.append(out)
            if extras:
                ckpt = _checkpoints(model_dir, actor, ckpt_dir, export_dir)
            del actor
    return _portable({"results": results, "ckpt": ckpt}) if rank == 0 else None


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("parallel_ckpt"))
    export_dir = str(tmp_path_factory.mktemp("parallel_export") / "hf")
    out = run_distributed(parallel_ppo_rank_fn, 4, tiny_model_dir, ckpt_dir, export_dir, timeout=900)[0]
    return _torch(out), export_dir


def _masked_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    mask = make_batch(NUM_ROWS)["response_mask"].double()
    return float(((a.double() - b.double()) * mask).abs().max())


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def _name(got) -> str:
    (tp, sp, packed), (ref, critic, fsdp_size) = got["layout"], got["roles"]
    roles = f" (ref tp={ref[0]} sp={ref[1]}, critic tp={critic[0]} sp={critic[1]})" if ref else ""
    hsdp = f" actor fsdp_size={fsdp_size}" if fsdp_size != -1 else ""
    return f"tp={tp} sp={sp} {'packed' if packed else 'plain'}{hsdp}{roles}"


def test_ppo_step_matches_one_rank_at_every_layout(run):
    (out, _) = run
    ref, layouts = out["results"][0], out["results"][1:]
    assert [tuple(g["layout"]) for g in layouts] == [(tp, sp, p) for tp, sp in LAYOUTS for p in (False, True)]
    # The clip acts (grad_clip=1.0), so the step depends on the global norm reduced across the layout.
    assert ref["actor_metrics"]["actor/grad_norm"] > 1.0 and ref["critic_metrics"]["critic/grad_norm"] > 1.0
    report = {}
    for got in layouts:
        name = _name(got)
        diffs = {key: _masked_diff(got[key], ref[key]) for key in ("old_log_probs", "entropys", "ref_log_prob",
                                                                   "values")}
        for key, diff in diffs.items():  # positions outside the response mask hold no defined value
            assert diff <= TOL["atol"] + TOL["rtol"] * float(ref[key].abs().max()), (name, key, diff)
        for role in ("actor_metrics", "critic_metrics"):
            assert got[role].keys() == ref[role].keys(), (name, role)
            for key, want in ref[role].items():
                rel = TOL["rtol"] if any(k in key for k in EXACT_METRICS) else FP32_STAT_RTOL
                assert got[role][key] == pytest.approx(want, rel=rel, abs=TOL["atol"]), (name, key, got[role][key], want)
        for role in ("actor_params", "critic_params"):
            diffs[role] = _max_diff(got[role], ref[role])
            for key, want in ref[role].items():
                torch.testing.assert_close(got[role][key], want, **TOL, msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        report[name] = {k: f"{v:.1e}" for k, v in diffs.items()}
    print("max abs differences to the one-rank float64 step:", report)


def test_parameter_gradient_and_optimizer_bytes_follow_the_plan(run):
    """Per rank: 1/(tp x dp_shard) of every split tensor, tp-replicated norms and heads 1/dp_shard."""
    (out, _) = run
    ref = out["results"][0]
    for got in out["results"][1:]:
        for role, mem in got["memory"].items():
            full = ref["memory"][role]["param"]
            assert mem["full"] == full == ref["memory"][role]["expected"], (role, mem, full)
            assert mem["param"] == mem["expected"], (_name(got), role, mem)
            assert mem["grad"] == mem["param"], (_name(got), role, mem)
            assert mem["optim"] == 2 * mem["param"], (_name(got), role, mem)  # AdamW exp_avg, exp_avg_sq
            # Only the replicated norms / biases / heads keep the share above 1/(tp x dp_shard).
            share = full / (mem["tp"] * mem["dp_shard"])
            assert share <= mem["param"] < 1.01 * share, (_name(got), role, mem)


def test_weight_sync_from_tp2_gives_the_tp1_greedy_output(run):
    (out, _) = run
    ref, = [r for r in out["results"] if r["layout"] == (1, 1, False)]
    tp2, = [r for r in out["results"] if r["extras"] and r["layout"] != (1, 1, False)]
    assert tuple(tp2["layout"]) == EXTRAS
    # The engine received every full parameter, gathered from the FSDP x TP DTensors, as the step left them.
    params = ref["actor_params"]
    assert set(params) <= set(tp2["synced"]) and set(tp2["synced"]) == set(ref["synced"])
    for name, want in params.items():
        assert tp2["synced"][name].shape == want.shape, name
        torch.testing.assert_close(tp2["synced"][name], want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(tp2["responses"], ref["responses"])
    for metrics in (ref["sync_metrics"], tp2["sync_metrics"]):  # reported as at tp=1
        assert {"timing_s/weight_sync", "perf/max_memory_allocated_gb/rollout"} <= set(metrics), metrics


def test_checkpoints_reshard_across_tp_and_hf_export_is_plain(run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    (out, export_dir) = run
    ckpt = out["ckpt"]
    saved = ckpt["saved"]
    for name, tp in (("tp1", 1), ("tp2_again", 2)):
        got = ckpt[name]
        assert got["tp"] == tp
        assert got["params"].keys() == saved["params"].keys() and got["optim"].keys() == saved["optim"].keys()
        for key, want in list(saved["params"].items()) + list(saved["optim"].items()):
            assert torch.equal(got["params"].get(key, got["optim"].get(key)), want), (name, key)
    files = [f for f in os.listdir(export_dir) if f.endswith(".safetensors")]
    tensors = {k: v for f in files for k, v in load_file(os.path.join(export_dir, f)).items()}
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float64)
    exported = dict(model.named_parameters())
    assert exported.keys() == saved["params"].keys()
    for key, want in saved["params"].items():
        assert torch.equal(exported[key].detach(), want), key
        if key in tensors:  # tied weights are written once
            assert type(tensors[key]) is torch.Tensor and torch.equal(tensors[key], want), key
