"""tinyzero.models."""
