"""A checkpoint's model weights read one whole tensor at a time, in one process, with no model.

``hf-export`` converts a checkpoint of any size on a machine that cannot hold it: it asks for
each weight when it needs it and drops it once written. ``CheckpointWeights`` is that read-only
mapping from the model's state-dict names (the checkpoint's ``model.{name}`` keys, ``sharded.py``)
to tensors; indexing reads the one tensor as a single full box (``boxes.Sharded``) through
``dcp_io.read_boxes``, which stitches it together from whichever ranks' files hold its chunks,
so a checkpoint written under any layout reads the same. Nothing is cached: a tensor lives as
long as the caller keeps it. Optimizer state is never read. Reading one briefly costs about twice
its stored size (DCP loads each stored chunk, then copies it into the box), plus the cast's copy:
measured, a 131 MB fp32 embedding exported to bf16 peaked at about 320 MB.

Opening checks every file against the completion marker and reads DCP's index through the
restricted unpickler (``checkpoint.open_checkpoint``), as every load does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from meshtron.checkpoint.boxes import Box, Sharded
from meshtron.checkpoint.checkpoint import CheckpointError, open_checkpoint, read_state

PREFIX = "model."


class CheckpointWeights(Mapping[str, torch.Tensor]):
    """``{state-dict name: tensor}`` of the tracker's (or ``iteration``'s) checkpoint in
    ``load_dir``, each tensor read when indexed and cast to ``dtype`` (default: as saved)."""

    def __init__(self, load_dir: str | os.PathLike, iteration: int | None = None, dtype: torch.dtype | None = None) -> None:
        opened = open_checkpoint(load_dir, iteration)
        if opened is None:
            raise CheckpointError(f"no checkpoint in {load_dir}: point --load at a directory written by --save")
        self.directory, record, self._metadata = opened
        self.meta: dict[str, Any] = {**record["meta"], "iteration": record["iteration"]}
        self.dtype = dtype
        entries = self._metadata.state_dict_metadata
        self.shapes = {key[len(PREFIX) :]: tuple(e.size) for key, e in entries.items() if key.startswith(PREFIX)}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        entry = self._metadata.state_dict_metadata[PREFIX + name]
        whole = torch.empty(self.shapes[name], dtype=entry.properties.dtype)
        key = PREFIX + name
        read_state({key: Sharded(self.shapes[name], whole.dtype, [Box((0,) * whole.dim(), whole)])}, self.directory, self._metadata)
        return whole if self.dtype is None else whole.to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def stored_dtype(self) -> torch.dtype:
        """The type most of the weights' elements are saved in (bf16 training saves bf16 weights)."""
        counts: dict[torch.dtype, int] = {}
        for name, shape in self.shapes.items():
            dtype = self._metadata.state_dict_metadata[PREFIX + name].properties.dtype
            counts[dtype] = counts.get(dtype, 0) + math.prod(shape)
        return max(counts, key=counts.get)

    def check_shapes(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raise unless the checkpoint holds exactly the weights ``expected`` (a model's state-dict
        shapes): a missing, extra or reshaped one means the config does not describe these weights."""
        missing = sorted(expected.keys() - self.shapes.keys())
        extra = sorted(self.shapes.keys() - expected.keys())
        if missing or extra:
            raise CheckpointError(f"{self.directory} does not hold the weights its config describes: "
                                  f"missing {missing[:3]}, not in the model {extra[:3]}")  # fmt: skip
        for name, shape in expected.items():
            if tuple(shape) != self.shapes[name]:
                raise CheckpointError(f"{self.directory} holds {name} of shape {list(self.shapes[name])}, its config implies {list(shape)}")
