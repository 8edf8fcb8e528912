"""DCP's ``.metadata`` read without running code from it.

DCP pickles its index (``Metadata``: each tensor's global shape, dtype, chunks, and where each
chunk's bytes are) and ``FileSystemReader.read_metadata`` loads it with plain ``pickle``, so a
crafted ``.metadata`` runs any function it names. Here the unpickler resolves only the globals a
meshtron checkpoint's index references (found by listing them for model + optimizer checkpoints in
fp32, bf16 and fp16), and the result is then checked for the shape DCP expects before DCP sees it.

``BytesStorageMetadata`` (a pickled Python object stored inside a ``.distcp``) is deliberately not
admitted: DCP unpickles such items with no restriction. meshtron stores tensors only.
"""

from __future__ import annotations

import io
import pickle
import pathlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.serialization import _get_layout

_ALLOWED: dict[tuple[str, str], Any] = {
    (cls.__module__, cls.__qualname__): cls
    for cls in (
        Metadata,
        StorageMeta,
        TensorStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.TensorProperties,
        dcp_metadata._MEM_FORMAT_ENCODING,
        _StorageInfo,
        torch.Size,
    )
}
# StorageMeta.checkpoint_id, the directory it was saved to (pathlib's module is pathlib._local from Python 3.13)
_ALLOWED.update({("pathlib", "PosixPath"): pathlib.PosixPath, ("pathlib._local", "PosixPath"): pathlib.PosixPath})
_ALLOWED[("torch.serialization", "_get_layout")] = _get_layout  # a lookup of torch.strided & co by name


class UnsafeMetadata(pickle.UnpicklingError):
    """A ``.metadata`` that names something other than DCP's index classes, or is not shaped like one."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadata(f"references {module}.{name}, which is not part of DCP's checkpoint index; refusing to unpickle it")


def read_metadata(path: Path) -> Metadata:
    """The DCP index at ``path``, unpickled with only the index classes admitted and then checked."""
    metadata = _IndexUnpickler(io.BytesIO(path.read_bytes())).load()
    _check_shape(metadata)
    return metadata


def _check_shape(metadata: Any) -> None:
    """Beyond the classes: every entry a tensor, every data file a plain name inside the
    checkpoint directory (a path like ``../../x`` would make DCP read outside it)."""
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadata(f"holds a {type(metadata).__name__}, not a DCP Metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeMetadata(f"entry {key!r} is a {type(entry).__name__}; meshtron checkpoints hold tensors only")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise UnsafeMetadata(f"points at data file {name!r}, which is not a file name inside the checkpoint directory")
        if info.transform_descriptors:
            raise UnsafeMetadata(f"asks for storage transforms {info.transform_descriptors!r}; meshtron writes none")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader handed an index already read by ``read_metadata`` (once, before any data
    file is opened), so DCP itself never unpickles ``.metadata``."""

    def __init__(self, path: str | Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata sets
        return self._metadata
