"""Durable file writes shared by checkpoints, role state and the run-folder lock.

    atomic_write_text(path, text)      # temp file, fsync, rename, fsync of the folder
"""

from __future__ import annotations

import os


def fsync_path(path: str, directory: bool = False) -> None:
    """fsync a file (or, with directory=True, a folder, so a rename inside it is durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` so a crash leaves the old file or the new one, never a torn one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)), directory=True)
