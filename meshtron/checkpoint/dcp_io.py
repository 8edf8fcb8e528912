"""Boxes of global tensors to DCP files and back, each rank on its own.

Why not ``dcp.save`` over the process group: its planning and its finish are collectives, which
an asynchronous save would have to run from a background thread beside training's collectives.
Instead each rank writes its boxes with ``no_dist`` (``write_rank_files``: its own
``__{rank}_0.distcp`` and an in-memory index of what is where), and the save's finalize, one
collective on the main thread, gathers the ranks' indexes and merges them into the one
``.metadata`` (``merge_indexes``) that DCP would have written, after checking that the ranks'
boxes cover every global tensor exactly once. The directory is then a plain DCP checkpoint.

Loading (``read_boxes``) goes through DCP's reader and its chunk-overlap planning
(``create_read_items_for_chunk_list``): each rank names the boxes it wants, DCP reads the stored
chunks they overlap, narrows them, and copies into the box views (casting the dtype).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from meshtron.checkpoint.boxes import Sharded
from meshtron.checkpoint.safe_metadata import SafeFileSystemReader


class _BoxSavePlanner(DefaultSavePlanner):
    """Plans one write per box of a flat ``{key: Sharded}``; the global plan of one rank covers
    only its boxes, so DCP's whole-tensor validation is left to ``merge_indexes``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, sharded in self.state_dict.items():
            for box in sharded.boxes:
                offsets = torch.Size(box.offsets)
                items.append(WriteItem(
                    index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, box.data.shape),
                                                properties=TensorProperties(dtype=sharded.dtype), size=torch.Size(sharded.shape)),
                ))  # fmt: skip
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        self.global_plan, self.metadata = create_default_global_save_plan(all_plans)
        return self.global_plan, self.metadata

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].box_at(index.offset)


class _RankFileWriter(FileSystemWriter):
    """DCP's file writer naming this rank's file ``__{rank}_0.distcp`` and keeping the index of
    what it wrote in memory (``index``) instead of writing a ``.metadata`` of its own."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path, sync_files=True, overwrite=True)
        self._rank = rank
        self.index: Metadata | None = None

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self._rank}_")) for plan in plans]

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        self.index = metadata


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns on every ``no_dist`` call that no process group is used; that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def write_rank_files(state: dict[str, Sharded], directory: Path, rank: int) -> Metadata:
    """Write this rank's boxes into ``directory`` (no collective); returns their index."""
    writer = _RankFileWriter(directory, rank)
    with quiet_single_process():
        dcp.save(state, storage_writer=writer, planner=_BoxSavePlanner(), no_dist=True)
    return writer.index


def merge_indexes(parts: list[Metadata]) -> Metadata:
    """The one DCP index of the ranks' ``parts``. Raises ValueError naming a tensor whose boxes do
    not cover it exactly once (a gap: a shard nobody wrote; an overlap: a replica written twice)."""
    tensors: dict[str, TensorStorageMetadata] = {}
    storage = {}
    for part in parts:
        for key, entry in part.state_dict_metadata.items():
            if key not in tensors:
                tensors[key] = TensorStorageMetadata(entry.properties, entry.size, [])
            elif tensors[key].size != entry.size or tensors[key].properties.dtype != entry.properties.dtype:
                raise ValueError(f"{key}: ranks disagree on its global shape or dtype ({list(entry.size)} vs {list(tensors[key].size)})")
            tensors[key].chunks.extend(entry.chunks)
        storage.update(part.storage_data)
    for key, entry in tensors.items():
        problem = _cover_problem(entry)
        if problem:
            raise ValueError(f"{key} {problem}")
    return Metadata(state_dict_metadata=tensors, storage_data=storage, storage_meta=StorageMeta())


def _cover_problem(entry: TensorStorageMetadata) -> str | None:
    """Why ``entry``'s chunks do not tile its global shape exactly, or None."""
    size, chunks = list(entry.size), entry.chunks
    for c in chunks:
        if any(o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, size)):
            return f"has a chunk {list(c.offsets)} + {list(c.sizes)} outside its shape {size}"
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            if all(max(oa, ob) < min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                return f"was written twice: chunks at {list(a.offsets)} and {list(b.offsets)} overlap"
    covered = sum(math.prod(c.sizes) for c in chunks)
    if covered != math.prod(size):
        return f"is incomplete: the ranks wrote {covered} of its {math.prod(size)} elements"
    return None


class _BoxLoadPlanner(DefaultLoadPlanner):
    """Plans the reads that fill each requested box from the stored chunks it overlaps."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Sharded], metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        """The boxes as they are (DCP's own set-up would walk them as a nested state dict)."""
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, sharded in self.state_dict.items():
            chunks = [ChunkStorageMetadata(torch.Size(b.offsets), b.data.shape) for b in sharded.boxes]
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].box_at(index.offset)


def read_boxes(state: dict[str, Sharded], directory: Path, metadata: Metadata) -> None:
    """Fill every box of ``state`` from the checkpoint in ``directory`` (no collective); the
    index ``metadata`` was read safely beforehand, and shapes were checked against it."""
    with quiet_single_process():
        dcp.load(state, storage_reader=SafeFileSystemReader(directory, metadata), planner=_BoxLoadPlanner(), no_dist=True)
