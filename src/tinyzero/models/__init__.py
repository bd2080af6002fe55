"""tinyzero.models: HF models from a local folder, the offline tiny model, FSDP2 wrapping.

    tinyzero.models.tiny     build_tiny_model(out_dir) / `python -m tinyzero.models.tiny --out DIR`
    tinyzero.models.loading  load_tokenizer, load_hf_config, load_causal_lm, check_model_path,
                             pick_dtype, pick_attn_implementation
    tinyzero.models.value    load_value_model (critic), load_reward_model
    tinyzero.models.fsdp     parallelize, load_sharded_model (meta init + rank-0 broadcast),
                             offload / load helpers
    tinyzero.models.config   ModelConfig, FSDPConfig, MixedPrecisionConfig

Submodules are imported on use so that `import tinyzero.models` stays light.
"""
