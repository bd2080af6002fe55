"""tinyzero.trainer."""
