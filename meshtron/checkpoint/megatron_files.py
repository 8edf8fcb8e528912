"""A Megatron-LM checkpoint directory opened for reading: which format, its common state, its tensors.

``{load}/latest_checkpointed_iteration.txt`` names ``iter_NNNNNNN/`` (or ``release/``), which is
either

* ``torch_dist``: a DCP directory (``.metadata``, ``__R_T.distcp``, ``metadata.json``); the common
  state (``args``, ``iteration``, ...) in ``common.pt`` before Megatron-Core 0.19, else pickled
  inside a ``.distcp`` under ``common_state``. Tensors are read one box at a time (one layer of a
  stacked tensor) through DCP's reader without a process group; or
* ``torch`` (legacy): ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per model-parallel rank, read
  one pipeline stage at a time (its tensor- and expert-parallel files together). With virtual
  pipeline stages each file holds its rank's model chunks as ``model0``, ``model1``, ...: stage
  ``v * pp + p`` of the model is chunk v of pipeline rank p (Megatron's interleaving), so each file
  is read once per chunk.

Every pickle goes through ``megatron_pickle`` (nothing from the files is run), DCP's index through
an unpickler that admits DCP's own classes only; data files shorter than the index says are named.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from meshtron.checkpoint.boxes import Box, Sharded
from meshtron.checkpoint.checkpoint import check_data_files, read_state
from meshtron.checkpoint.megatron_pickle import UnsafePickle, load_megatron_pickle
from meshtron.checkpoint.safe_metadata import _IndexUnpickler, UnsafeMetadata
from meshtron.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
COMMON = "common.pt"
COMMON_KEY = "common_state"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_CHUNK = re.compile(r"model(\d+)")  # a virtual pipeline stage's state dict


def megatron_checkpoint_dir(load_dir: str | os.PathLike, iteration: int | None = None) -> Path:
    """``iter_NNNNNNN`` (or ``release``) of the tracker's iteration, or of ``iteration``."""
    root = Path(load_dir)
    if iteration is None:
        tracker = root / TRACKER
        if not tracker.is_file():
            raise CheckpointError(f"{tracker} is missing: point --load at the directory Megatron-LM's --save wrote")
        text = tracker.read_text().strip()
        if text != "release" and not text.isdigit():
            raise CheckpointError(f"{tracker} holds {text[:40]!r}, neither an iteration nor 'release'")
        directory = root / ("release" if text == "release" else f"iter_{int(text):07d}")
    else:
        directory = root / f"iter_{iteration:07d}"
    if not directory.is_dir():
        raise CheckpointError(f"{directory} does not exist (named by {root / TRACKER} or --ckpt-step)")
    return directory


def _plain(value: Any, source: str) -> Any:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        return value[0]  # Megatron-Core 0.19 keeps the common state as a one-element list
    if not isinstance(value, dict):
        raise CheckpointError(f"{source} holds a {type(value).__name__}, not Megatron's common state dict")
    return value


def _load_pickle(source: Path | bytes, name: str) -> Any:
    try:
        return load_megatron_pickle(source, name)
    except (UnsafePickle, ValueError) as exc:
        raise CheckpointError(str(exc)) from None


def rank_dir(tp: int, pp: int, ep: int, pp_size: int, ep_size: int) -> str:
    """The legacy directory of one model-parallel rank: ``mp_rank_TT[_PPP][_EEE]``."""
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pp_size > 1 else "") + (f"_{ep:03d}" if ep_size > 1 else "")


# -- torch_dist -----------------------------------------------------------------------------------


class _MegatronIndexUnpickler(_IndexUnpickler):
    """DCP's index classes plus the ones Megatron-Core's planner leaves in it (byte items, its plan)."""

    _extra = {(c.__module__, c.__qualname__): c for c in (BytesStorageMetadata, SavePlan, WriteItem, WriteItemType, TensorWriteData)}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._extra:
            return self._extra[(module, name)]
        return super().find_class(module, name)


def read_dist_metadata(directory: Path) -> Metadata:
    """DCP's index of a torch_dist directory, read safely, every data file checked to be whole."""
    import io

    path = directory / ".metadata"
    try:
        metadata = _MegatronIndexUnpickler(io.BytesIO(path.read_bytes())).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete torch_dist checkpoint") from None
    except UnsafeMetadata as exc:
        raise CheckpointError(f"{path} {exc}") from None
    except Exception as exc:
        raise CheckpointError(f"{path} is corrupt: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a DCP index")
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{path} points at data file {name!r}, which is not a file name inside {directory}")
        if info.transform_descriptors:
            raise CheckpointError(f"{path} asks for storage transforms {info.transform_descriptors!r}, which are not read here")
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    check_data_files(directory, needed)
    return metadata


class DistCheckpoint:
    """A torch_dist directory: ``common`` (args etc.), ``shapes`` of its tensors, ``read``."""

    format = "torch_dist"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.metadata = read_dist_metadata(directory)
        entries = self.metadata.state_dict_metadata
        self.shapes = {k: tuple(e.size) for k, e in entries.items() if isinstance(e, TensorStorageMetadata)}
        self.objects = sorted(k for k, e in entries.items() if isinstance(e, BytesStorageMetadata))
        self.common = self._common()
        self.names = list(self.shapes)  # the tensors' keys

    def _common(self) -> dict[str, Any]:
        legacy = self.directory / COMMON
        if legacy.is_file():
            return _plain(_load_pickle(legacy, str(legacy)), str(legacy))
        for index, info in (self.metadata.storage_data or {}).items():
            if index.fqn.split("/")[0] == COMMON_KEY:
                path = self.directory / info.relative_path
                with open(path, "rb") as f:
                    f.seek(info.offset)
                    raw = f.read(info.length)
                return _plain(_load_pickle(raw, f"{path} ({index.fqn})"), str(path))
        raise CheckpointError(f"{self.directory} has neither {COMMON} nor a '{COMMON_KEY}' entry: Megatron's args are missing")

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        """Tensor ``key``, or its slice ``index`` along the leading (layer) axis, read alone."""
        if key not in self.shapes:
            raise CheckpointError(f"{self.directory} has no tensor {key}")
        shape, dtype = self.shapes[key], self.metadata.state_dict_metadata[key].properties.dtype
        if index is None:
            box = torch.empty(shape, dtype=dtype)
            read_state({key: Sharded(shape, dtype, [Box((0,) * len(shape), box)])}, self.directory, self.metadata)
            return box
        box = torch.empty((1, *shape[1:]), dtype=dtype)
        read_state({key: Sharded(shape, dtype, [Box((index,) + (0,) * (len(shape) - 1), box)])}, self.directory, self.metadata)
        return box[0]


# -- legacy torch ---------------------------------------------------------------------------------


class LegacyCheckpoint:
    """``mp_rank_*`` files: ``common`` from the first, then ``stages()`` one pipeline stage at a time."""

    format = "torch"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        first = self._path(0, 0, 0, probe=True)
        self._first = _load_pickle(first, str(first))
        if not isinstance(self._first, dict) or "model" not in self._first and "model0" not in self._first:
            raise CheckpointError(f"{first} is not a Megatron model_optim_rng.pt (no 'model' entry)")
        chunks = sorted((int(m.group(1)) for k in self._first if (m := _CHUNK.fullmatch(k))))
        if chunks and chunks != list(range(len(chunks))):
            raise CheckpointError(f"{first} holds virtual pipeline stages {[f'model{c}' for c in chunks]}, "
                                  f"not model0..model{len(chunks) - 1}")  # fmt: skip
        self.chunks = [f"model{c}" for c in chunks] or ["model"]  # the state dicts of a file, in order
        if any(not isinstance(self._first[c], dict) for c in self.chunks):
            raise CheckpointError(f"{first} is not a Megatron model_optim_rng.pt ({', '.join(self.chunks)} not all state dicts)")
        self.common = {k: v for k, v in self._first.items() if k not in ("optimizer", *self.chunks)}
        self.names = [k for c in self.chunks for k in self._first[c]]  # the first rank's keys
        args = self.common.get("args")
        fields = args.fields() if hasattr(args, "fields") else {}
        self.tp = int(fields.get("tensor_model_parallel_size", 1))
        self.pp = int(fields.get("pipeline_model_parallel_size", 1))
        self.ep = int(fields.get("expert_model_parallel_size", 1))

    def _path(self, tp: int, pp: int, ep: int, probe: bool = False) -> Path:
        """The file of one rank; ``probe``: the first one, before the layout is known."""
        if probe:
            found = sorted(p for p in self.directory.glob("mp_rank_*") if _RANK_DIR.fullmatch(p.name))
            if not found:
                raise CheckpointError(f"{self.directory} has no mp_rank_* directory: not a legacy Megatron checkpoint")
            path = found[0] / LEGACY_FILE
        else:
            path = self.directory / rank_dir(tp, pp, ep, self.pp, self.ep) / LEGACY_FILE
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing (tensor rank {tp}, pipeline rank {pp}, expert rank {ep} of "
                                  f"tp {getattr(self, 'tp', '?')}, pp {getattr(self, 'pp', '?')}, ep {getattr(self, 'ep', '?')})")  # fmt: skip
        return path

    def first_file(self) -> dict[str, Any]:
        """Everything rank (0, 0, 0) saved (read again once ``stages`` has let it go)."""
        if not self._first:
            path = self._path(0, 0, 0)
            self._first = _load_pickle(path, str(path))
        return self._first

    def stages(self, select: Callable[[dict[str, Any], str, Path], dict[str, torch.Tensor]] | None = None,
               ) -> Iterator[tuple[int, dict[tuple[int, int], dict[str, torch.Tensor]]]]:  # fmt: skip
        """``(stage, {(tp rank, ep rank): tensors})`` for each stage in the model's layer order (with
        virtual stages, chunk v of every pipeline rank before chunk v + 1). The tensors are
        ``select(file's content, chunk key, path)``, by default the chunk's model state."""
        paths = {(t, p, e): self._path(t, p, e) for p in range(self.pp) for t in range(self.tp) for e in range(self.ep)}
        for v, chunk in enumerate(self.chunks):
            for p in range(self.pp):
                files = {}
                for t in range(self.tp):
                    for e in range(self.ep):
                        path = paths[(t, p, e)]
                        loaded = self.first_file() if (t, p, e) == (0, 0, 0) else _load_pickle(path, str(path))
                        model = loaded.get(chunk) if isinstance(loaded, dict) else None
                        if not isinstance(model, dict):
                            raise CheckpointError(f"{path} is not a Megatron model_optim_rng.pt (no '{chunk}' state dict)")
                        tensors = {k: x for k, x in model.items() if isinstance(x, torch.Tensor)}
                        files[(t, e)] = select(loaded, chunk, path) if select else tensors
                yield v * self.pp + p, files
                self._first = {}


def open_megatron(load_dir: str | os.PathLike, iteration: int | None = None) -> DistCheckpoint | LegacyCheckpoint:
    directory = megatron_checkpoint_dir(load_dir, iteration)
    if (directory / ".metadata").is_file():
        return DistCheckpoint(directory)
    if any(directory.glob("mp_rank_*")):
        return LegacyCheckpoint(directory)
    raise CheckpointError(f"{directory} is neither a torch_dist checkpoint (no .metadata) nor a legacy one (no mp_rank_* directories)")
