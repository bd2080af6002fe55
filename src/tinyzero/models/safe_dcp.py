"""Load torch DCP checkpoints without running code a crafted checkpoint carries.

torch's FileSystemReader unpickles `.metadata` with plain `pickle.load`, and its default load
planner reads non-tensor entries (optimizer param groups) with `torch.load(weights_only=False)`:
a checkpoint folder from someone else could run any code on resume. Here the metadata goes
through an unpickler that admits only the DCP metadata classes (checked on torch 2.13), and
byte entries through `torch.load(weights_only=True)`; anything else fails with an error naming
the file and the refused name.

    reader = SafeFileSystemReader(role_dir)
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
"""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

# (module, name) pairs a DCP .metadata pickle may reference.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name ("torch.strided") to the layout
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file references something the restricted loader does not admit."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.path}: refusing to load {module}.{name}; a DCP .metadata file holds only checkpoint "
            "metadata, so this file was crafted or corrupted. Load checkpoints only from sources you trust")


def load_dcp_metadata(file, path: str):
    """Unpickle a DCP `.metadata` stream admitting only the metadata classes; errors name `path`."""
    try:
        return _MetadataUnpickler(file, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means an unreadable file
        raise UnsafeCheckpointError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from None


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose read_metadata uses the restricted unpickler."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_dcp_metadata(f, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
