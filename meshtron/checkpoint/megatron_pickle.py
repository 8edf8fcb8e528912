"""Megatron's pickles (``model_optim_rng.pt``, ``common.pt``, the common state inside a ``.distcp``)
read without running code from them.

They are ``torch.save`` zip archives whose ``data.pkl`` holds the run's ``argparse.Namespace``, a
few Megatron enums (``AttnBackend``, ...), NumPy's RNG state and tensors. ``torch.load`` refuses
the Namespace with ``weights_only=True``, and without it would run any function the file names.
This unpickler resolves only a fixed list of globals to plain values: the Namespace and the enums
become stand-ins built here (``Namespace``, ``EnumValue``: attributes and a name, nothing imported
from the file's modules), tensors are rebuilt by torch's own ``_rebuild_tensor_v2`` from storages
read out of the archive, and anything else is refused by its name before it is called. A tensor
that carried attributes (the fp32 main params of a mixed-precision optimizer keep Megatron's
``tensor_model_parallel`` / ``partition_dim``) is pickled through ``_rebuild_from_type_v2``: it is
rebuilt as a plain tensor here, its attributes dropped (``_plain_tensor``).
"""

from __future__ import annotations

import codecs
import collections
import functools
import io
import pickle
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch

# Modules whose classes a Megatron checkpoint pickles as enums (REDUCE(cls, (value,))).
ENUM_MODULES = ("megatron.core.transformer.enums", "megatron.core.enums", "megatron.core.model_parallel_config",
                "megatron.core.optimizer.optimizer_config", "megatron.core.dist_checkpointing.strategies.fully_parallel",
                "megatron.training.checkpointing", "signal")  # fmt: skip


class UnsafePickle(pickle.UnpicklingError):
    """A Megatron pickle that names a global outside the plain values it may hold."""


class Namespace:
    """Stand-in for ``argparse.Namespace``: the pickled attributes, nothing else."""

    def fields(self) -> dict[str, Any]:
        return dict(vars(self))

    def __repr__(self) -> str:
        return f"Namespace({len(vars(self))} fields)"


@dataclass(frozen=True)
class EnumValue:
    """Stand-in for a pickled enum member: its class's dotted name and its value."""

    kind: str
    value: Any


TENSOR_TYPE = "torch.Tensor"  # stands for the class in a pickle; a string, so a pickle cannot call it


def _plain_tensor(rebuild: Any, kind: Any, args: tuple, state: Any) -> torch.Tensor:
    """``torch._tensor._rebuild_from_type_v2`` for a plain ``torch.Tensor`` with attributes:
    ``rebuild`` (an allowed global, as the pickle resolved it) applied to ``args``; ``state``, the
    attributes, is dropped."""
    if kind is not TENSOR_TYPE:
        raise UnsafePickle(f"rebuilds a tensor as {kind!r}, not a plain torch.Tensor")
    tensor = rebuild(*args)
    if not isinstance(tensor, torch.Tensor):
        raise UnsafePickle(f"rebuilds a {type(tensor).__name__} where a tensor was expected")
    return tensor


def _numpy_reconstruct() -> dict[tuple[str, str], Any]:
    reconstruct = numpy.ndarray.__reduce__(numpy.zeros(1))[0]  # numpy's own _reconstruct, whatever its module
    return {(m, "_reconstruct"): reconstruct for m in ("numpy.core.multiarray", "numpy._core.multiarray")}


_ALLOWED: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): Namespace,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._tensor", "_rebuild_from_type_v2"): _plain_tensor,
    ("torch", "Tensor"): TENSOR_TYPE,
    ("_codecs", "encode"): codecs.encode,  # how protocol-2 pickles spell bytes
    ("numpy", "ndarray"): numpy.ndarray,
    ("numpy", "dtype"): numpy.dtype,
    **_numpy_reconstruct(),
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.source = archive, prefix, source
        self.storages: dict[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name.endswith("Storage") and isinstance(getattr(torch, name, None), type):
            return getattr(torch, name)  # a storage's element type, read by persistent_load only
        if module in ENUM_MODULES and name.isidentifier():
            return functools.partial(EnumValue, f"{module}.{name}")
        raise UnsafePickle(f"references {module}.{name}, which is not among the plain values a Megatron checkpoint holds; "
                           "refusing to unpickle it (nothing from the file was run)")  # fmt: skip

    def persistent_load(self, pid: Any) -> Any:
        """A tensor's storage: ('storage', storage type, key, location, numel), bytes at data/{key}."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)):
            raise UnsafePickle(f"has a persistent id {pid!r:.80} that is not a tensor storage")
        _, storage_type, key, _, numel = pid
        if key not in self.storages:
            try:
                raw = self.archive.read(f"{self.prefix}/data/{key}")
            except KeyError:
                raise UnsafePickle(f"names tensor storage {key!r}, which the archive lacks") from None
            dtype = storage_type.dtype
            if len(raw) != numel * dtype.itemsize:
                raise UnsafePickle(f"storage {key!r} holds {len(raw)} bytes, its header says {numel} x {dtype}")
            untyped = torch.UntypedStorage.from_buffer(raw, dtype=torch.uint8) if raw else torch.UntypedStorage(0)
            with warnings.catch_warnings():  # torch.load builds the same typed wrapper; it warns only when users do
                warnings.simplefilter("ignore", UserWarning)
                self.storages[key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        return self.storages[key]


def load_megatron_pickle(source: Path | bytes, name: str | None = None) -> Any:
    """The plain values of a ``torch.save`` archive (a file, or its bytes, named ``name`` in errors).
    Raises UnsafePickle for a global outside the allowed list, ValueError for a damaged archive."""
    label = name or str(source)
    try:
        archive = zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ValueError(f"{label} is not a torch.save archive (damaged, truncated, or saved by torch < 1.6): {exc}") from None
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError(f"{label} is not a torch.save archive (no single */data.pkl inside)")
        prefix = pickles[0].split("/")[0]
        order = f"{prefix}/byteorder"
        if order in archive.namelist() and archive.read(order).decode() != "little":
            raise ValueError(f"{label} was saved on a big-endian machine; only little-endian archives are read")
        try:
            return _Unpickler(archive.read(pickles[0]), archive, prefix, label).load()
        except UnsafePickle as exc:
            raise UnsafePickle(f"{label} {exc}") from None
        except (zipfile.BadZipFile, EOFError, pickle.UnpicklingError, RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"{label} is damaged: {type(exc).__name__}: {exc}") from None
