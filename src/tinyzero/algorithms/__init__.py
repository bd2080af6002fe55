"""tinyzero.algorithms."""
