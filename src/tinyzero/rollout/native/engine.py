"""The native rollout engine: batched generation in plain torch, on CPU or GPU.

The engine owns an inference copy of the HF model, built from the HF config on its device
(bf16 on GPU, fp32 on CPU unless rollout.dtype says otherwise). The trainer pushes its
weights into that copy before each rollout (`update_weights`, in place, from
`full_params.iter_full_params`), so generation never runs under FSDP2 and the copy is the
only extra memory (one model in inference dtype plus the KV cache).

Usage:
    engine = NativeRollout(config, hf_config, device)
    engine.update_weights(iter_full_params(actor_module, bucket_bytes))
    out = engine.generate_sequences(prompt_batch)   # DataProto, see tinyzero.rollout.outputs
"""

from __future__ import annotations

import torch

from tinyzero.protocol import DataProto
from tinyzero.rollout.config import RolloutConfig
from tinyzero.rollout.device import cuda_memory_gb, resolve_dtype
from tinyzero.rollout.engine import sampling_params
from tinyzero.rollout.generate import generate
from tinyzero.rollout.native.decoder import build_decoder
from tinyzero.rollout.outputs import PROMPT_KEYS, build_output, check_prompt_batch, repeat_prompts
from tinyzero.rollout.sampling import draw_uniforms, make_generator
from tinyzero.runtime.host_memory import release_freed_memory


def build_inference_model(hf_config, device: torch.device, dtype: torch.dtype, model_path: str | None = None,
                          trust_remote_code: bool = False) -> torch.nn.Module:
    """The engine's own model: weights read from `model_path`, or left as initialized (to be pushed)."""
    from transformers import AutoModelForCausalLM

    if model_path:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, config=hf_config, dtype=dtype, attn_implementation="sdpa",
            trust_remote_code=trust_remote_code, local_files_only=True).to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa",
                                                     trust_remote_code=trust_remote_code)
    model.eval()
    model.requires_grad_(False)
    return model


class NativeRollout:
    """Rollout engine over an inference copy of the model (see module docstring)."""

    def __init__(self, config: RolloutConfig, hf_config, device: torch.device | str, model_path: str | None = None,
                 dp_rank: int = 0, trust_remote_code: bool = False, tp_group=None):
        self.config = config
        self.device = torch.device(device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = build_inference_model(hf_config, self.device, self.dtype, model_path, trust_remote_code)
        self.decoder = build_decoder(self.model, config.native_impl, compile=config.native_compile)
        self.tp_comm = None  # rollout.tensor_model_parallel_size > 1: the group's collectives (tp_comm.py)
        if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
            from tinyzero.rollout.native.tp_comm import build_comm

            self.tp_comm = build_comm(tp_group, self.device)
            self._split_decoder()
        self.dp_rank = dp_rank
        self.num_calls = 0
        self.memory: dict[str, float] = {}
        self._targets = dict(self.model.state_dict(keep_vars=True))
        self._discarded: list[tuple[torch.nn.Parameter, torch.Size]] = []  # level-2 sleep: (param, shape)
        self._unset: dict[int, str] | None = None  # after a level-2 sleep: parameters not written since

    def _split_decoder(self) -> None:
        """With a tensor-parallel group, the fused decoder splits its MLPs and lm_head over it; the HF
        decoder cannot, so every rank of the group generates the whole batch alone."""
        if self.tp_comm is not None and hasattr(self.decoder, "set_tensor_parallel"):
            self.decoder.set_tensor_parallel(self.tp_comm)

    # ------------------------------------------------------------------ weights and memory
    @torch.no_grad()
    def update_weights(self, named_tensors) -> int:
        """Copy (hf_name, full tensor) pairs into the inference copy, in place; returns the count."""
        if self._discarded:  # a level-2 sleep without wake_up: allocate the weights to write
            self.wake_up(tags=["weights"])
        self._targets = dict(self.model.state_dict(keep_vars=True))
        count = 0
        for name, tensor in named_tensors:
            target = self._targets.get(name)
            if target is None:
                raise ValueError(f"update_weights: {name!r} is not a parameter of the rollout model "
                                 f"({type(self.model).__name__}); names must be HF names")
            if target.shape != tensor.shape:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the rollout model expects {tuple(target.shape)}")
            target.data.copy_(tensor, non_blocking=True)
            if self._unset is not None:
                self._unset.pop(id(target), None)
            count += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return count

    @torch.no_grad()
    def update_lora(self, named_tensors, scaling: float) -> int:
        """Take LoRA adapter pairs (`<layer>.lora_A.weight`, `.lora_B.weight`); returns the count.
        rollout.lora_merge: merge them into the inference copy, W = W_base + scaling * B @ A, from base
        weights kept once (tinyzero.models.lora.AdapterMerger); else keep them unmerged (`_update_unmerged`)."""
        if not self.config.lora_merge:
            return self._update_unmerged(named_tensors, scaling)
        from tinyzero.models.lora import AdapterMerger

        if getattr(self, "_lora_merger", None) is None:
            self._lora_merger = AdapterMerger(self.model)
        return self.update_weights(self._lora_merger.merged(named_tensors, scaling))

    def _update_unmerged(self, named_tensors, scaling: float) -> int:
        """rollout.lora_merge=false: the first sync turns each adapted nn.Linear of the inference copy into a
        LoraLinear (same base weight, adapters in the engine's dtype) and rebuilds the decoder, which applies
        them beside the base matmuls; every sync copies the adapters in place."""
        from tinyzero.models.lora import LORA_PARTS, LoraLinear, LoraSpec, replace_with_lora

        installed, count = False, 0
        for name, tensor in named_tensors:
            if not name.endswith(LORA_PARTS):
                raise ValueError(f"update_lora: {name!r} is not an adapter weight (<layer>.lora_A.weight / .lora_B.weight)")
            layer_name, part = name[:-len(".lora_A.weight")], name[-len("A.weight")]
            try:
                layer = self.model.get_submodule(layer_name)
            except AttributeError:
                layer = None
            if not isinstance(layer, torch.nn.Linear):
                raise ValueError(f"update_lora: {layer_name!r} is not a linear layer of the rollout model "
                                 f"({type(self.model).__name__}); names must be HF names")
            if not isinstance(layer, LoraLinear):
                rank = tensor.shape[0] if part == "A" else tensor.shape[1]
                layer = replace_with_lora(self.model, layer_name, LoraSpec(rank, scaling * rank), self.dtype,
                                          init=False)
                installed = True
            layer.scaling = scaling
            target = (layer.lora_A if part == "A" else layer.lora_B).weight
            if target.shape != tensor.shape:
                raise ValueError(f"update_lora: {name!r} has shape {tuple(tensor.shape)}, the rollout model's "
                                 f"adapter has {tuple(target.shape)} (the LoRA rank changed?)")
            target.data.copy_(tensor)  # in place: the decoder's fused adapters view these
            if self._unset is not None:
                self._unset.pop(id(target), None)
            count += 1
        if installed:
            self.decoder = build_decoder(self.model, self.config.native_impl, compile=self.config.native_compile)
            self._split_decoder()
        return count

    def sleep(self) -> None:
        """rollout.sleep_level 1, on GPU: free the KV cache and move the weights to host memory (on CPU
        there is nothing to free). Level 2, on any device: free the KV cache and discard the weights,
        handing their memory back to the system (the trainer re-sends every weight before the next
        generation). Nothing when rollout.free_cache_engine is off."""
        if not self.config.free_cache_engine:
            return
        if self.config.sleep_level == 2:
            self._discard_weights()
            return
        if self.device.type != "cuda":
            return
        self.decoder.release()  # also drops the fused device buffers the parameters view
        self.model.to("cpu")
        torch.cuda.empty_cache()
        self.memory["after_sleep_gb"] = cuda_memory_gb(self.device)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring the weights back (tags None or containing "weights"): level 1 on GPU moves them to the
        device, level 2 allocates them empty for the sync to fill; the KV cache is allocated by the
        next generate."""
        if tags is not None and "weights" not in tags:
            return
        if self._unset is not None:
            for param, shape in self._discarded:
                param.data = torch.empty(shape, dtype=param.dtype, device=self.device)
            self._discarded = []
        elif self.device.type == "cuda":
            self.model.to(self.device)
        self.memory["after_wake_up_gb"] = cuda_memory_gb(self.device)

    def _check_weights_set(self) -> None:
        """After a level-2 sleep, every parameter must have been written again before generating."""
        if self._unset is None:
            return
        if self._unset:
            missing = sorted(set(self._unset.values()))
            raise RuntimeError(
                f"the native engine discarded its weights (rollout.sleep_level=2) and {len(missing)} were not "
                f"synced since (e.g. {missing[0]!r}); sleep_level=2 needs the trainer to re-send every weight "
                "before each generation: use rollout.sleep_level=1 where the engine has no actor to sync from")
        self._unset = None

    def _discard_weights(self) -> None:
        """Level-2 sleep: every parameter's storage freed (shapes kept for wake_up), the KV cache and the
        fused buffers too; until update_weights has written every parameter again, generate refuses."""
        if self._unset is not None:
            return
        self.decoder.release()
        params = list(self.model.parameters())  # tied weights once
        self._discarded = [(p, p.shape) for p in params]
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self._unset = {id(p): name for name, p in self.model.named_parameters()}
        release_freed_memory(self.device)

    def memory_metrics(self) -> dict[str, float]:
        """Device memory (GiB allocated) recorded after the last sleep / wake_up / generate; {} off GPU."""
        if self.device.type != "cuda":
            return {}
        return {f"rollout/mem_{k}": v for k, v in self.memory.items()}

    def shutdown(self) -> None:
        """Free the KV cache (the model copy goes with the engine object)."""
        self.decoder.release()

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        check_prompt_batch(prompts)
        self._check_weights_set()
        params = sampling_params(self.config, prompts.meta_info, self.num_calls, self.dp_rank)
        self.num_calls += 1
        n, R = params.n, params.response_length
        rows = len(prompts) * n
        # Prefix sharing: generate() gets the distinct prompts and decodes n rows of each.
        mode = self.config.native_prefix_sharing
        if mode == "auto":
            mode = "shared" if self.device.type == "cuda" else "copy"
        group = 1 if mode == "off" else n
        src = prompts.batch if group > 1 else dict(zip(PROMPT_KEYS, repeat_prompts(prompts, n)))
        ids, mask, pos = (src[k].to(self.device) for k in PROMPT_KEYS)
        generator = make_generator(self.device, params.seed)
        chunk = self.config.max_num_seqs
        # Uniforms per max_num_seqs rows, in row order: the same samples whatever the prompts' grouping.
        uniforms = None if params.greedy else torch.cat(
            [draw_uniforms((R, min(rows, s + chunk) - s), generator, self.device) for s in range(0, rows, chunk)], 1)
        sync_every = 16 if self.device.type == "cuda" else 4
        parts = []
        for p0, p1, g, r0 in plan_chunks(ids.shape[0], group, chunk):
            self.decoder.reset(p1 - p0, ids.shape[1], R, g, shared_kv=mode == "shared")
            u = None if uniforms is None else uniforms[:, r0:r0 + (p1 - p0) * g]
            parts.append(generate(self.decoder, ids[p0:p1], mask[p0:p1], pos[p0:p1], params, None, sync_every,
                                  group_size=g, uniforms=u))
        # torch.cat copies generate()'s inference tensors into ordinary ones (the trainer writes into them).
        responses, response_mask, log_probs = (torch.cat(x, dim=0) for x in zip(*parts))
        # The temperature the log-probs were taken at (greedy: none, they are at T = 1), for compute_log_prob.
        meta = {} if params.greedy else {"temperature": params.temperature}
        prompt_rows = (t.cpu() for t in repeat_prompts(prompts, n))
        out = build_output(*prompt_rows, responses.cpu(), response_mask.cpu(), log_probs.cpu(), meta_info=meta)
        if self.device.type == "cuda":
            self.memory["peak_generate_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out


def plan_chunks(num_prompts: int, group_size: int, max_rows: int) -> list[tuple[int, int, int, int]]:
    """Split num_prompts prompts of group_size rows each into decode batches of at most max_rows rows:
    (first prompt, end prompt, rows per prompt, first row) per batch, in row order. Whole groups go
    together; a group larger than max_rows is split into sub-groups that each prefill the prompt."""
    if group_size <= max_rows:
        per = max_rows // group_size
        return [(p, min(num_prompts, p + per), group_size, p * group_size) for p in range(0, num_prompts, per)]
    return [(p, p + 1, min(max_rows, group_size - j), p * group_size + j)
            for p in range(num_prompts) for j in range(0, group_size, max_rows)]
