"""tinyzero.rollout."""
