"""tinyzero.rewards."""
