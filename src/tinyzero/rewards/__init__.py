"""Rule-based rewards keyed by data_source: scorers, the registry, safe arithmetic, RewardManager.

    from tinyzero.rewards import default_compute_score, RewardManager, RewardConfig
    default_compute_score("countdown", "<answer>(3 + 5) * 8</answer>", {"target": 64, "numbers": [3, 5, 8]})

Scorer modules: `countdown`, `arithmetic` (TinyZero's multiply / arithmetic), `math_boxed` (a lenient
\\boxed scorer); veRL's rules: `gsm8k`, `math_reward` (MATH), `math_dapo` (math / aime*), `prime_math`
(numina_*), `geo3k`, `search_r1` (see registry for the data_source table). `RewardManager`, `RewardOutput` and `RewardError` are imported lazily so
that scoring worker processes do not pay for importing torch.
"""

from tinyzero.rewards import (
    arithmetic,
    countdown,
    geo3k,
    gsm8k,
    math_boxed,
    math_dapo,
    math_reward,
    prime_math,
    search_r1,
)
from tinyzero.rewards.config import RewardConfig
from tinyzero.rewards.registry import (
    SCORERS,
    check_data_sources,
    default_compute_score,
    get_scorer,
    load_custom_fn,
    register_scorer,
)
from tinyzero.rewards.safe_eval import SafeEvalError, safe_eval

__all__ = [
    "RewardConfig",
    "RewardError",
    "RewardManager",
    "RewardOutput",
    "SCORERS",
    "SafeEvalError",
    "arithmetic",
    "check_data_sources",
    "countdown",
    "default_compute_score",
    "geo3k",
    "get_scorer",
    "gsm8k",
    "load_custom_fn",
    "math_boxed",
    "math_dapo",
    "math_reward",
    "prime_math",
    "search_r1",
    "register_scorer",
    "safe_eval",
]


def __getattr__(name):
    if name in ("RewardError", "RewardManager", "RewardOutput"):
        from tinyzero.rewards import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'tinyzero.rewards' has no attribute {name!r}")
