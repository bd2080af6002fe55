"""Moved to tinyzero.models.hf_export (below workers/, which export through it); kept for old imports."""

from tinyzero.models.hf_export import export_hf, iter_export_tensors  # noqa: F401
