"""tinyzero.workers."""
