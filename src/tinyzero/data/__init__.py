"""tinyzero.data."""
