"""Reading and writing the root config: YAML round trip, presets, and the command line.

    cfg = parse_args(["--preset", "demo_cpu", "--trainer.total_training_steps", "10"])
    dump_yaml(cfg, "runs/x/config.yaml"); cfg = load_yaml("runs/x/config.yaml")

Command line (see train.py): `[MODE] [--preset NAME] [--config FILE] [--section.field VALUE ...]`.
`--preset NAME` picks a preset (a function in tinyzero.configs) as the defaults, `--config run.yaml`
loads a saved config on top of it, and every field is a flag parsed by tyro on top of both. Errors
a user can cause (a malformed file, a wrong type, an unknown flag) are one-line `ConfigError`s.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from typing import Any, Literal

import yaml

from tinyzero.config import Config, ConfigError, nearest


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
    if hint is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {value}; write a number (e.g. 0 or 1e9) instead")
    if hint is int and isinstance(value, float) and value.is_integer():
        value = int(value)
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
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not a UTF-8 text file (byte {e.start}: {e.reason}); pass a YAML "
                          "config (e.g. RUN/config.yaml), not a binary file") from None
    except yaml.YAMLError as e:
        # Tags such as !!python/object are refused by the safe loader: a config holds plain values only.
        problem = " ".join(str(e).split())
        raise ConfigError(f"--config {path}: not a plain YAML config ({problem})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: config section <root> must be a mapping, got {type(values).__name__}")
    try:
        base = base if base is not None else Config()
        if _has_interpolation(values):  # veRL's YAML: ${section.key} and ${oc.env:VAR}
            values = _resolve_interpolations(values, base)
        return apply_settings(base, [(k, v, None) for k, v in flatten_settings(values)], source="file")
    except ConfigError as e:
        raise ConfigError(f"--config {path}: {e}") from None


def _has_interpolation(values: Any) -> bool:
    if isinstance(values, dict):
        return any(_has_interpolation(v) for v in values.values())
    if isinstance(values, list):
        return any(_has_interpolation(v) for v in values)
    return isinstance(values, str) and "${" in values


def _resolve_interpolations(values: dict, base: Config) -> dict:
    """OmegaConf's resolution of `${...}` (what veRL's Hydra config does when it loads): a reference
    may name a key of the file or of the config under it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.create(to_dict(base)), OmegaConf.create(values))
        resolved = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot resolve an interpolation ({' '.join(str(e).split())[:200]})") from None

    def pick(file_part: Any, full: Any) -> Any:  # the file's keys only, with their resolved values
        if isinstance(file_part, dict) and isinstance(full, dict):
            return {k: pick(v, full.get(k)) for k, v in file_part.items()}
        return full

    return pick(values, resolved)


# --------------------------------------------------------------------------- presets and CLI


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


_DELETE = object()  # Hydra's `~key`: the field goes back to its default


def _is_override(arg: str) -> bool:
    """A Hydra override (`a.b=c`, `+a.b=c`, `++a.b=c`, `~a.b`) rather than a value of a `--flag`."""
    if arg.startswith("~"):
        return True
    key = arg.lstrip("+").split("=", 1)[0]
    return "=" in arg and bool(key) and all(part.isidentifier() for part in key.split("."))


def _hydra_op(arg: str) -> tuple[str, Any, str | None]:
    """(key, value, the value's text) of one Hydra override, values typed as Hydra types them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        override = OverridesParser.create().parse_override(arg)
    except HydraException as e:
        problem = " ".join(str(e).split())[:200]
        raise ConfigError(f"cannot parse the override {arg!r} ({problem}); write key=value, +key=value, "
                          "++key=value or ~key, quoting values with spaces: key='a b'") from None
    if override.is_delete():
        return override.key_or_group, _DELETE, None
    return override.key_or_group, override.value(), arg.split("=", 1)[1]


def _flag_ops(args: list[str]) -> list[tuple[str, Any, str | None]]:
    """The command line after the mode, --preset and --config as ordered (key, value, text) operations.

    `--a.b VALUE [VALUE ...]` (tinyzero's flags; several values for a list) and Hydra's overrides mix
    freely; the later setting of a key wins."""
    ops, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            name, eq, text = arg[2:].partition("=")
            name = name.replace("-", "_")
            if eq:
                values, i = [text], i + 1
            else:
                values, i = [], i + 1
                while i < len(args) and not args[i].startswith("--") and not _is_override(args[i]):
                    values.append(args[i])
                    i += 1
            ops.append((name, values, None))  # no value: an empty list for a list field, else an error
        elif _is_override(arg):
            ops.append(_hydra_op(arg))
            i += 1
        else:
            raise ConfigError(f"unexpected argument {arg!r}: settings are --section.field VALUE or "
                              "section.field=VALUE (Hydra style); `train.py --help` lists the fields")
    return ops


def _field_hint(path: str) -> tuple[bool, Any]:
    """(whether path names a field or section of the root config, its type)."""
    cls: Any = Config
    for part in path.split("."):
        if not dataclasses.is_dataclass(cls):
            return False, None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False, None
        cls = hints[part]
    return True, cls


def _from_tokens(tokens: list[str], hint: Any, where: str) -> Any:
    """The value of `--where TOKEN [TOKEN ...]` for a field of type `hint` (tinyzero's flag syntax)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    if optional and len(tokens) == 1 and tokens[0] in ("None", "null", "none", "~"):
        return None
    listy = [a for a in ([hint] + args) if typing.get_origin(a) in (list, tuple) or a in (list, tuple, dict)]
    if not tokens:
        if typing.get_origin(hint) is list:
            return []
        raise ConfigError(f"--{where} needs a value (e.g. --{where} VALUE or {where}=VALUE)")
    if listy or hint is dict:
        if len(tokens) == 1 and tokens[0][:1] in "[{":
            return _hydra_value(tokens[0])
        if hint is dict or dict in args:
            raise ConfigError(f"--{where} takes a mapping written as {{key: value, ...}}")
        if len(tokens) > 1 or typing.get_origin(hint) in (list, tuple):
            return [_scalar_text(t) for t in tokens]
    if len(tokens) != 1:
        raise ConfigError(f"--{where} takes one value, got {len(tokens)}: {' '.join(tokens)}"[:300])
    return tokens[0]


def _scalar_text(text: str) -> Any:
    """A list element written on the command line: a number where it reads as one, else the text."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _set_path(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        node = tree.get(part)
        if not isinstance(node, dict):
            node = tree[part] = {}
        tree = node
    tree[leaf] = value


def _default_of(path: str) -> Any:
    """The field's default in tinyzero's own config (what Hydra's `~key` goes back to)."""
    obj: Any = Config()
    for part in path.split("."):
        obj = getattr(obj, part)
    return to_dict(obj)


def flatten_settings(values: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(key, value) leaves of a nested mapping of settings, in order: a tinyzero section is opened, a
    tinyzero field (a mapping-typed one too) is a leaf, and another key is a leaf when veRL's table
    knows it, else opened (veRL's nested keys such as ray_kwargs.ray_init.num_cpus). veRL's
    `_target_` markers and Hydra's own `defaults` / `hydra` entries carry no setting."""
    from tinyzero.config.verl import resolve_key

    out = []
    for key, value in values.items():
        if key == "_target_" or (not prefix and key in ("defaults", "hydra")):
            continue
        path = f"{prefix}{key}"
        known, hint = _field_hint(path)
        if isinstance(value, dict) and value and (
                (known and dataclasses.is_dataclass(hint)) or (not known and resolve_key(path, value) == [(path, value)])):
            out.extend(flatten_settings(value, path + "."))
        else:
            out.append((path, value))
    return out


def apply_settings(base: Config, ops: list[tuple[str, Any, str | None]], source: str = "flag") -> Config:
    """`base` with the (key, value, text) settings applied in order, veRL keys resolved onto tinyzero's
    (tinyzero.config.verl); the later setting of a key wins. `text` is the value as a Hydra override
    wrote it (None for a `--flag`'s tokens and for a file's values): a string field keeps it as written
    (`name=007`). `source` ("flag" or "file") words the error for an unknown key."""
    from tinyzero.config.verl import resolve_key

    tree: dict = {}
    for key, value, text in _expand_sections(ops):
        key, value = _into_mapping_field(base, tree, key, value)
        known, hint = _field_hint(key)
        if value is _DELETE:
            if known and not dataclasses.is_dataclass(hint):
                _set_path(tree, key, _default_of(key))
            elif not known:
                resolve_key(key, None)  # a refused key is refused, an ignored one says so
            continue
        if known and text is None and source == "flag" and isinstance(value, list) \
                and not dataclasses.is_dataclass(hint):
            value = _from_tokens(value, hint, key)  # --key TOKEN [TOKEN ...]
        elif known and text is not None and _accepts_str(hint) and value is not None \
                and not isinstance(value, (str, list, dict)):
            value = text  # key=007 into a string field stays "007"
        elif not known and text is None and source == "flag" and isinstance(value, list):
            if not value:
                raise ConfigError(f"--{key} needs a value (e.g. --{key} VALUE or {key}=VALUE)")
            value = _hydra_value(value[0]) if len(value) == 1 else [_hydra_value(v) for v in value]
        for name, resolved in resolve_key(key, value):
            if source == "flag":
                _check_known(name, key, text)
            _set_path(tree, name, resolved)
    return merge_dict(base, tree)


def _into_mapping_field(base: Config, tree: dict, key: str, value: Any) -> tuple[str, Any]:
    """`field.sub.key=value` on a mapping-typed field (reward_kwargs, override_config) -> the whole mapping
    with that entry set, on top of what the field holds so far; any other setting passes unchanged."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:i])
        known, hint = _field_hint(head)
        if not known:
            continue
        if hint is not dict and typing.get_origin(hint) is not dict:
            return key, value
        current: Any = tree
        for part in parts[:i]:
            current = current.get(part) if isinstance(current, dict) else None
        if current is None:
            current = base
            for part in parts[:i]:
                current = getattr(current, part)
        mapping = copy.deepcopy(dict(current))
        node = mapping
        for part in parts[i:-1]:
            node = node.setdefault(part, {})
        if value is _DELETE:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = value
        return head, mapping
    return key, value


def _expand_sections(ops):
    """A mapping set on a whole section (`actor_rollout_ref.actor.optim={lr:1e-6}`, a file's nested
    sections) becomes one setting per leaf."""
    for key, value, text in ops:
        known, hint = _field_hint(key)
        if known and dataclasses.is_dataclass(hint) and isinstance(value, dict):
            yield from ((k, v, None) for k, v in flatten_settings(value, key + "."))
        else:
            yield key, value, text


def _hydra_value(text: str) -> Any:
    """A value typed as Hydra types it (for a veRL key given as `--key VALUE`)."""
    return _hydra_op(f"x={text}")[1]


def _check_known(name: str, key: str, text: str | None) -> None:
    """An unknown key is a ConfigError naming the nearest field (the whole path, as the user writes it)."""
    if _field_hint(name)[0]:
        return
    shown = f"flag --{key}" if text is None else f"setting {key}"
    raise ConfigError(f"unknown {shown}{nearest(name, flag_names())}; `train.py --help` lists tinyzero's "
                      "settings and docs/verl.md the veRL keys it takes")


def _accepts_str(hint: Any) -> bool:
    return hint is str or (typing.get_origin(hint) in (typing.Union, types.UnionType) and str in typing.get_args(hint))
