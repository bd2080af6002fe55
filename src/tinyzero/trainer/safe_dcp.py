"""Moved to tinyzero.models.safe_dcp (below workers/, which read role checkpoints with it); kept for old imports."""

from tinyzero.models.safe_dcp import (  # noqa: F401
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_dcp_metadata,
)
