"""The run's configuration: the root config and its checks (root), reading and writing it (parse), veRL's
keys (verl). What a run derives from it on a world of ranks is the run plan (tinyzero.plan).

    from tinyzero.config import Config, ConfigError
    from tinyzero.config.parse import load_yaml, dump_yaml
    from tinyzero.cli import parse_args
"""

from tinyzero.config.pipeline import PipelineConfig
from tinyzero.config.reliability import ReliabilityConfig
from tinyzero.config.root import (
    MODES,
    Config,
    ConfigError,
    DPOConfig,
    TrainerConfig,
    check_config,
    check_model_context,
    nearest,
)

__all__ = ["MODES", "Config", "ConfigError", "DPOConfig", "PipelineConfig", "ReliabilityConfig", "TrainerConfig", "check_config", "check_model_context",
           "nearest"]
