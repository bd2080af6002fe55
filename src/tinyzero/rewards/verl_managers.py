"""veRL's reward managers (reward_model.reward_manager: naive, batch, dapo, prime) as settings of the
RewardManager: what scores the samples and how it is called (`scorer_spec`), and the DAPO manager's
overlong penalty from reward_model.reward_kwargs (`dapo_overlong`). What each manager does is described
in tinyzero.rewards.manager.
"""

from __future__ import annotations

from tinyzero.rewards.config import (
    REWARD_MANAGERS,
    CustomRewardFunctionConfig,
    OverlongBufferConfig,
    RewardConfig,
)
from tinyzero.rewards.scoring import ScorerSpec

__all__ = ["DAPO_KWARGS", "dapo_overlong", "scorer_spec"]

DAPO_KWARGS = ("overlong_buffer_cfg", "max_resp_len")


def dapo_overlong(manager_kwargs: dict) -> tuple[OverlongBufferConfig | None, bool, int | None]:
    """(overlong config or None, log, max_resp_len) from the dapo manager's reward_kwargs."""
    cfg = manager_kwargs.get("overlong_buffer_cfg")
    if cfg is None:
        return None, False, None
    if not isinstance(cfg, dict):
        raise ValueError(f"reward_model.reward_kwargs.overlong_buffer_cfg must be a mapping (enable, len, "
                         f"penalty_factor, log), got {cfg!r:.100}")
    unknown = sorted(set(cfg) - {"enable", "len", "penalty_factor", "log"})
    if unknown:
        raise ValueError(f"reward_model.reward_kwargs.overlong_buffer_cfg: unknown keys {unknown}; known: enable, "
                         "len, penalty_factor, log")
    buffer = OverlongBufferConfig(enable=bool(cfg.get("enable", False)), len=int(cfg.get("len", 4096)),
                                  penalty_factor=float(cfg.get("penalty_factor", 1.0)))
    max_resp_len = manager_kwargs.get("max_resp_len")
    if buffer.enable and max_resp_len is not None and int(max_resp_len) < buffer.len:
        raise ValueError(f"reward_model.reward_kwargs.max_resp_len={max_resp_len} must be >= "
                         f"overlong_buffer_cfg.len={buffer.len}")
    return buffer, bool(cfg.get("log", False)), None if max_resp_len is None else int(max_resp_len)


def scorer_spec(config: RewardConfig, custom: CustomRewardFunctionConfig | None, manager: str,
                 manager_kwargs: dict) -> ScorerSpec:
    """What scores the samples and how it is called; ValueError naming the setting for a bad combination."""
    if manager not in REWARD_MANAGERS:
        raise ValueError(f"reward_model.reward_manager must be one of {REWARD_MANAGERS}, got {manager!r}")
    if not isinstance(manager_kwargs, dict):
        raise ValueError(f"reward_model.reward_kwargs must be a mapping, got {manager_kwargs!r:.100}")
    path = custom.spec() if custom is not None else None
    if path and config.custom_fn:
        raise ValueError(f"both custom_reward_function.path ({path}) and reward.custom_fn ({config.custom_fn}) are "
                         "set; keep one (custom_reward_function is veRL's name and takes reward_kwargs)")
    if manager == "batch" and not path:
        raise ValueError("reward_model.reward_manager=batch calls a batch reward function: set "
                         "custom_reward_function.path (and .name) to a function taking data_sources, "
                         "solution_strs, ground_truths, extra_infos")
    if manager == "dapo":
        unknown = sorted(set(manager_kwargs) - set(DAPO_KWARGS))
        if unknown:
            raise ValueError(f"reward_model.reward_kwargs: the dapo reward manager takes {list(DAPO_KWARGS)}, "
                             f"got {unknown}")
    elif manager != "batch" and manager_kwargs:
        raise ValueError(f"reward_model.reward_kwargs {sorted(manager_kwargs)} are arguments of the reward manager; "
                         f"the {manager} manager takes none (batch passes them to the batch function, dapo takes "
                         f"{list(DAPO_KWARGS)}); arguments of the reward function go in "
                         "custom_reward_function.reward_kwargs")
    options = config.scorer_options()
    if path:
        kwargs = dict(custom.reward_kwargs)
        if manager == "batch":
            kwargs = {**manager_kwargs, **kwargs}  # veRL: the function's own kwargs win over the manager's
        call = {"batch": "batch", "prime": "prime"}.get(manager, "keyword")
        return ScorerSpec(custom_fn=path, call=call, reward_kwargs=kwargs, options=options)
    if config.custom_fn:
        return ScorerSpec(custom_fn=config.custom_fn, call="prime" if manager == "prime" else "positional",
                          options=options)
    return ScorerSpec(options=options)
