"""Reading and writing the root config: YAML round trip, presets, and the command line.

    cfg = parse_args(["--preset", "demo_cpu", "--trainer.total_training_steps", "10"])
    dump_yaml(cfg, "runs/x/config.yaml"); cfg = load_yaml("runs/x/config.yaml")

Command line (see train.py): `[MODE] [--preset NAME] [--config FILE] [--section.field VALUE ...]`.
`--preset NAME` picks a preset (a function in tinyzero.configs) as the defaults, `--config run.yaml`
loads a saved config on top of it, and every field is a flag parsed by tyro on top of both. Errors
a user can cause (a malformed file, a wrong type, an unknown flag) are one-line `ConfigError`s.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from typing import Any, Literal

import yaml

from tinyzero.config import MODES, Config, ConfigError, nearest


def to_dict(cfg: Any) -> Any:
    """A config as plain dicts / lists / scalars (YAML-safe)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg




def merge_dict(base: Any, values: dict, path: str = "") -> Any:
    """A copy of dataclass `base` with `values` (nested dicts) applied; unknown keys raise ValueError."""
    if not isinstance(values, dict):
        raise ConfigError(f"config section {path or '<root>'} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(type(base))
    names = [f.name for f in dataclasses.fields(base)]
    changes = {}
    for key, value in values.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key {where!r}{nearest(str(key), names)}; "
                             f"valid keys here: {', '.join(names)}")
        current = getattr(base, key)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            changes[key] = merge_dict(current, value, where)
        elif dataclasses.is_dataclass(current):
            raise ConfigError(f"config section {where} must be a mapping of its fields, got "
                              f"{type(value).__name__} {value!r}"[:300])
        else:
            changes[key] = _check_type(_coerce(value, hints.get(key)), hints.get(key), where)
    try:
        return dataclasses.replace(base, **changes)
    except TypeError as e:
        raise ConfigError(f"config section {path or '<root>'}: {e}") from e


def _coerce(value: Any, hint: Any) -> Any:
    """YAML lists back to tuples where the field is a tuple."""
    origin = typing.get_origin(hint)
    if isinstance(value, list) and (origin is tuple or hint is tuple):
        return tuple(value)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for arg in typing.get_args(hint):
            if typing.get_origin(arg) is tuple and isinstance(value, list):
                return tuple(value)
    return value


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """A YAML value must fit its field's scalar type or choices (lists and dicts are left to the field's
    own checks); numbers written as strings ("1e-6", which YAML reads as a string) become numbers."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{where}={value!r} is not valid{nearest(str(value), [str(c) for c in choices])}; "
                              f"choose one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return value
        for arg in args:
            if arg is not type(None):
                try:
                    return _check_type(value, arg, where)
                except ConfigError:
                    pass
        names = " or ".join("None" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)
        raise ConfigError(f"{where} must be {names}, got {type(value).__name__} {value!r}"[:300])
    if hint in (int, float) and isinstance(value, str):
        try:
            value = int(value) if hint is int else float(value)
        except ValueError:
            pass
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}.get(hint)
    if ok is not None and not ok(value):
        raise ConfigError(f"{where} must be {hint.__name__}, got {type(value).__name__} {value!r}"[:300])
    return value


def dump_yaml(cfg: Config, path: str) -> None:
    """Write the resolved config (rerun it with `--config path`)."""
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False, default_flow_style=False)


def load_yaml(path: str, base: Config | None = None) -> Config:
    """Read a (full or partial) YAML config on top of `base` (default: Config())."""
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path}: is a folder; pass a YAML file (e.g. RUN/config.yaml)") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        # Tags such as !!python/object are refused by the safe loader: a config holds plain values only.
        problem = " ".join(str(e).split())
        raise ConfigError(f"--config {path}: not a plain YAML config ({problem})") from None
    try:
        return merge_dict(base if base is not None else Config(), values)
    except ConfigError as e:
        raise ConfigError(f"--config {path}: {e}") from None


# --------------------------------------------------------------------------- presets and CLI


def load_preset(name: str) -> Config:
    """The root config a preset function in tinyzero.configs returns."""
    from tinyzero.configs import PRESETS

    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{nearest(name, PRESETS)}; available: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()


def _pop_option(args: list[str], flag: str) -> tuple[list[str], str | None]:
    out, value, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a == flag:
            if i + 1 >= len(args):
                raise ConfigError(f"{flag} needs a value")
            value, i = args[i + 1], i + 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return out, value


def _normalize_bool(arg: str) -> str:
    """Accept true/false in any case (veRL style) for boolean flags, which tyro spells True/False."""
    flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if value.lower() in ("true", "false"):
        value = value.capitalize()
    return f"{flag}{eq}{value}" if eq else value if not flag else arg


def flag_names(cls: type = None, prefix: str = "") -> list[str]:
    """Every command-line flag name of the root config ("trainer.total_epochs", ...)."""
    cls = Config if cls is None else cls
    names = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        if dataclasses.is_dataclass(hint):
            names.extend(flag_names(hint, f"{prefix}{f.name}."))
        else:
            names.append(f"{prefix}{f.name}")
    return names


def check_flags(args: list[str]) -> None:
    """An unknown `--section.field` is a ConfigError naming the nearest valid flag."""
    valid = set(flag_names())
    for arg in args:
        if not arg.startswith("--") or arg in ("--help",):
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        if name not in valid:
            raise ConfigError(f"unknown flag --{name}{nearest(name, valid)}; `train.py --help` lists them all")


def parse_args(argv: list[str] | None = None) -> Config:
    """`[MODE] [--preset NAME] [--config FILE] [--section.field VALUE ...]` -> Config.

    MODE (ppo|sft|rm|dpo) sets trainer.mode; the preset gives the defaults, the YAML file overrides
    them, the flags override both.
    """
    import tyro

    args = list(sys.argv[1:] if argv is None else argv)
    mode = None
    if args and args[0] in MODES:
        mode = args.pop(0)
    args, preset = _pop_option(args, "--preset")
    args, config_path = _pop_option(args, "--config")
    base = load_preset(preset) if preset else Config()
    if config_path:
        base = load_yaml(config_path, base)
    if mode is not None:
        base = merge_dict(base, {"trainer": {"mode": mode}})
    check_flags(args)
    args = [_normalize_bool(a) for a in args]
    from tinyzero.configs import PRESETS

    description = (
        "tinyzero: RL post-training (PPO/GRPO/...), SFT, RM and DPO.\n\n"
        "usage: train.py [ppo|sft|rm|dpo] [--preset NAME] [--config run.yaml] [--section.field VALUE ...]\n"
        f"presets: {', '.join(sorted(PRESETS))}"
    )
    cfg = tyro.cli(Config, default=base, args=args, description=description, use_underscores=True,
                   config=(tyro.conf.FlagConversionOff,))
    return cfg
