"""The command line of train.py (and of every program that takes a run config): presets, a config
file, flags and Hydra overrides, in that order.

    cfg = parse_args(["ppo", "--preset", "demo_cpu", "trainer.total_epochs=2", "--data.seed", "3"])

The grammar (Hydra's overrides, tinyzero's flags, veRL's keys) and the YAML files are
tinyzero.config's; the presets are tinyzero.configs'. This module sits above both.
"""

from __future__ import annotations

import os
import sys

from tinyzero.config import MODES, Config, ConfigError, nearest
from tinyzero.config.parse import _flag_ops, _pop_option, apply_settings, load_yaml, merge_dict
from tinyzero.configs import PRESETS

__all__ = ["load_preset", "parse_args"]

def load_preset(name: str) -> Config:
    """The root config a preset function in tinyzero.configs returns."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{nearest(name, PRESETS)}; available: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()


def parse_args(argv: list[str] | None = None) -> Config:
    """`[MODE] [--preset NAME] [--config FILE] [--section.field VALUE | section.field=VALUE ...]` -> Config.

    MODE (ppo|sft|rm|dpo) sets trainer.mode; the preset gives the defaults, the YAML file (tinyzero's
    saved config.yaml or a veRL-style config) overrides them, the settings override both, in order.
    Settings take tinyzero's flags (`--trainer.total_epochs 2`) and Hydra's override grammar as veRL's
    scripts write it (`trainer.total_epochs=2`, `+trainer.val_before_train=False`, `~key`); veRL's keys
    resolve onto tinyzero's (tinyzero.config.verl, docs/verl.md).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    mode = None
    if args and args[0] in MODES:
        mode = args.pop(0)
    args, preset = _pop_option(args, "--preset")
    args, config_path = _pop_option(args, "--config")
    args, config_dir = _pop_option(args, "--config-path")
    args, config_name = _pop_option(args, "--config-name")
    if config_name and not config_path:  # veRL's launcher: --config-path DIR --config-name NAME
        name = config_name if config_name.endswith((".yaml", ".yml")) else config_name + ".yaml"
        config_path = os.path.join(config_dir or ".", name)
    base = load_preset(preset) if preset else Config()
    if config_path:
        base = load_yaml(config_path, base)
    if mode is not None:
        base = merge_dict(base, {"trainer": {"mode": mode}})
    if "--help" in args or "-h" in args:
        _print_help(base)
    return apply_settings(base, _flag_ops(args))


def _print_help(base: Config) -> None:
    """`--help`: every field with its docstring (tyro), under the preset's and file's values; exits."""
    import tyro

    description = (
        "tinyzero: RL post-training (PPO/GRPO/...), SFT, RM and DPO.\n\n"
        "usage: train.py [ppo|sft|rm|dpo] [--preset NAME] [--config run.yaml] [--section.field VALUE ...] "
        "[section.field=VALUE ...]\n"
        "Settings are tinyzero flags or Hydra overrides (veRL's keys too: docs/verl.md); the later one wins.\n"
        f"presets: {', '.join(sorted(PRESETS))}"
    )
    tyro.cli(Config, default=base, args=["--help"], description=description, use_underscores=True,
             config=(tyro.conf.FlagConversionOff,))
