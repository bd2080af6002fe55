"""One warning per setting a trainer overrides: the user learns which value was replaced, by what, and why.

    arr.rollout.n = warn_override("actor_rollout_ref.rollout.n", arr.rollout.n, 2,
                                  "DPO trains on a chosen and a rejected row per pair", default=1)
    override(arr.rollout, "n", 2, "actor_rollout_ref.rollout.n", "...")   # the same; default from the dataclass

Nothing is said when the value already is the one the trainer needs, or when it is still the
field's default (the user did not choose it). Each field warns once per process, on rank 0.
"""

from __future__ import annotations

import dataclasses
import warnings

_UNSET = object()
_warned: set[str] = set()


def warn_override(field: str, old, new, why: str, default=_UNSET):
    """Return `new` (the caller assigns it), warning once when it replaces a value the user chose."""
    if old == new or (default is not _UNSET and old == default) or field in _warned:
        return new
    _warned.add(field)
    from tinyzero.distributed import get_rank

    if get_rank() == 0:
        warnings.warn(f"{field}={old!r} is overridden with {new!r}: {why}", UserWarning, stacklevel=2)
    return new


def field_default(obj, name: str):
    """The dataclass default of obj.name (a default_factory is called); a sentinel when there is none."""
    for f in dataclasses.fields(obj):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return _UNSET


def override(obj, name: str, new, field: str, why: str) -> None:
    """Set the dataclass field obj.name to `new`, warning (warn_override) when the user chose another value."""
    setattr(obj, name, warn_override(field, getattr(obj, name), new, why, default=field_default(obj, name)))
