"""The run's configuration: the root config and its checks (root), reading and writing it (parse).

    from tinyzero.config import Config, ConfigError
    from tinyzero.config.parse import parse_args, load_yaml, dump_yaml
"""

from tinyzero.config.root import (
    MODES,
    Config,
    ConfigError,
    DPOConfig,
    TrainerConfig,
    check_config,
    check_model_context,
    check_world,
    critic_mini_batch_size,
    nearest,
    pool_sizes,
    sync_derived_fields,
)

__all__ = ["MODES", "Config", "ConfigError", "DPOConfig", "TrainerConfig", "check_config", "check_model_context",
           "check_world", "critic_mini_batch_size", "nearest", "pool_sizes", "sync_derived_fields"]
