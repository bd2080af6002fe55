"""warn_override / override: a setting a trainer replaces is named once, with the value and the reason."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from operator import attrgetter

import pytest

from tinyzero.config import overrides
from tinyzero.config.overrides import override, warn_override


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(overrides, "_warned", set())


@dataclass
class Section:
    n: int = 1
    names: list = field(default_factory=lambda: ["a"])


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught]


def test_warns_once_naming_field_values_and_reason():
    out, msgs = _caught(lambda: warn_override("x.n", 3, 2, "pairs need two rows"))
    assert out == 2
    assert msgs == ["x.n=3 is overridden with 2: pairs need two rows"]
    _, again = _caught(lambda: warn_override("x.n", 5, 2, "pairs need two rows"))
    assert again == []  # once per field


def test_silent_when_equal_or_default():
    assert _caught(lambda: warn_override("x.a", 2, 2, "why")) == (2, [])
    assert _caught(lambda: warn_override("x.b", 1, 2, "why", default=1)) == (2, [])


def test_override_reads_the_dataclass_default_and_assigns():
    s = Section()
    _, msgs = _caught(lambda: override(s, "n", 2, "sec.n", "why"))
    assert s.n == 2 and msgs == []  # 1 is the default: the user did not choose it
    s = Section(n=4, names=["b"])
    _, msgs = _caught(lambda: (override(s, "n", 2, "sec.n", "why"), override(s, "names", ["a"], "sec.names", "w")))
    assert s.n == 2 and s.names == ["a"]
    assert msgs == ["sec.n=4 is overridden with 2: why", "sec.names=['b'] is overridden with ['a']: w"]


def test_dpo_settings_name_real_fields():
    from tinyzero.config import Config
    from tinyzero.trainer.dpo import DPO_SETTINGS

    cfg = Config()
    for name, value, why in DPO_SETTINGS:
        section, attr = name.rsplit(".", 1)
        assert hasattr(attrgetter(section)(cfg), attr), name
        assert type(getattr(attrgetter(section)(cfg), attr)) is type(value) and why


def test_derived_rollout_lengths_warn_when_the_user_set_them():
    from tinyzero.config import Config
    from tinyzero.plan import sync_derived_fields

    cfg = Config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 32
    _, msgs = _caught(lambda: sync_derived_fields(cfg))
    assert msgs == [] and cfg.actor_rollout_ref.rollout.prompt_length == 64  # defaults follow data silently
    cfg = Config()
    cfg.data.max_prompt_length, cfg.actor_rollout_ref.rollout.prompt_length = 64, 100
    _, msgs = _caught(lambda: sync_derived_fields(cfg))
    assert cfg.actor_rollout_ref.rollout.prompt_length == 64
    assert msgs == ["actor_rollout_ref.rollout.prompt_length=100 is overridden with 64: it follows "
                    "data.max_prompt_length (set that instead)"]
