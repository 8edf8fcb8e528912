"""Where a rank's part of a parameter lies in the global tensor, as boxes.

DCP stores a global tensor as chunks, each an axis-aligned box (offsets and sizes in the global
shape) written by some rank; at load each rank asks for its own boxes and DCP reads their overlap
with the stored ones, whatever layout wrote them. So a sharded checkpoint needs, per tensor, the
boxes this rank holds and views of its memory for each. A rank's part is rarely one box:

- tensor parallelism: ``ParamMeta.local_index`` maps the local rows (along ``tp_dim``) to global
  rows. It is a union of contiguous *runs*: one for ``Contiguous``; one per half for ``Halves``
  (SwiGLU's gate run and up run); for ``GroupedHeads`` with fewer kv heads than ranks, the query
  run and the group's k/v run. Each run is a box of the global tensor, which keeps the stored shape
  the one-process shape (no logical view needed). The k/v rows several tp ranks hold are written by
  the copy ``Replicas.counted`` marks, once; every copy reads them.
- the distributed optimizer: a rank owns the flat elements ``[start, end)`` of the local tensor,
  which split into boxes that are each a contiguous run of flat memory (a partial first row, whole
  rows, a partial last row, recursively over the dims): ``flat_boxes``.
- expert parallelism: a routed expert weight holds experts ``ParamMeta.expert_index()``, a run of
  dim 0 (the global expert id), so its boxes sit that many experts further along dim 0.
- FSDP2 parameters are DTensors: their placement gives the one box (``dtensor_box``); routed
  experts are DTensors over the expert-data-parallel group, that box shifted to their experts
  (and cut into this rank's etp runs under expert tensor parallelism).

The box views alias the live tensors: saving reads them, loading writes into them in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshtron.models.contract import ParamMeta

try:  # FSDP2 parameters are DTensors
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor
    from torch.distributed._tensor._utils import compute_local_shape_and_global_offset

Offsets = tuple[int, ...]


@dataclass
class Box:
    """``data`` (a view, of the box's size) sits at ``offsets`` in the global tensor."""

    offsets: Offsets
    data: torch.Tensor


@dataclass
class Sharded:
    """One global tensor as this rank saves or loads it: the global ``shape`` and ``dtype`` (what
    the checkpoint records) and the boxes of it this rank writes or reads (possibly none)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[Box]

    def box_at(self, offsets: Offsets) -> torch.Tensor:
        for box in self.boxes:
            if tuple(box.offsets) == tuple(offsets):
                return box.data
        raise KeyError(f"no box at {tuple(offsets)}")

    def nbytes(self) -> int:
        return sum(b.data.numel() * b.data.element_size() for b in self.boxes)


def tp_runs(meta: ParamMeta | None, writing: bool) -> list[tuple[int, int, int]] | None:
    """``(local start, global start, length)`` of each run of rows along ``meta.tp_dim`` this rank
    holds (``writing``: only the rows it is the one writer of); None when the parameter is whole."""
    if meta is None or meta.tp_dim is None or meta.tp_size == 1:
        return None
    index = meta.local_index()
    keep = torch.ones(len(index), dtype=torch.bool)
    rep = meta.replicas()
    if writing and rep is not None and not rep.counted:
        keep[rep.local] = False
    local = torch.nonzero(keep).flatten()
    if local.numel() == 0:
        return []
    glob = index[local]
    breaks = torch.nonzero((local.diff() != 1) | (glob.diff() != 1)).flatten() + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), len(local)]
    return [(int(local[a]), int(glob[a]), b - a) for a, b in zip(starts, ends)]


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[Offsets, tuple[int, ...]]]:
    """Split the flat elements ``[lo, hi)`` of a contiguous tensor of ``shape`` into boxes
    ``(offsets, sizes)``, each one contiguous run of flat memory (at most 2 per dim)."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if lo % inner == 0 and hi % inner == 0:
        return [((first, *[0] * (len(shape) - 1)), (last - first + 1, *shape[1:]))]
    if first == last:  # inside one row: recurse into it
        return [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo - first * inner, hi - first * inner)]
    head_end = (first + 1) * inner if lo % inner else lo
    tail_start = last * inner if hi % inner else hi
    return flat_boxes(shape, lo, head_end) + flat_boxes(shape, head_end, tail_start) + flat_boxes(shape, tail_start, hi)


def param_boxes(data: torch.Tensor, local_shape: tuple[int, ...], meta: ParamMeta | None, start: int = 0,
                writing: bool = False) -> Sharded:  # fmt: skip
    """The boxes of a parameter-shaped tensor that ``data`` holds: its flat elements are
    ``[start, start + numel)`` of this rank's local (tp-sharded) tensor of ``local_shape`` (the
    whole local tensor when ``start`` is 0 and the sizes match)."""
    if isinstance(data, DTensor):
        return dtensor_box(data, meta)
    shape = tuple(meta.global_shape) if meta is not None and data.dim() else tuple(local_shape)
    experts = meta.expert_index() if meta is not None and data.dim() else None
    first_expert = int(experts[0]) if experts is not None else 0
    flat = data.detach().view(-1)
    runs = tp_runs(meta, writing) if data.dim() else None
    strides = [math.prod(local_shape[i + 1 :]) for i in range(len(local_shape))]
    boxes = []
    for offsets, sizes in flat_boxes(tuple(local_shape), start, start + flat.numel()):
        first = sum(o * s for o, s in zip(offsets, strides)) - start
        view = flat[first : first + math.prod(sizes)].view(sizes)
        if runs is None:
            boxes.append(Box(_shift(offsets, first_expert), view))
            continue
        d = meta.tp_dim
        for local_start, global_start, length in runs:
            a, b = max(local_start, offsets[d]), min(local_start + length, offsets[d] + sizes[d])
            if a < b:
                at = list(_shift(offsets, first_expert))
                at[d] = global_start + a - local_start
                boxes.append(Box(tuple(at), view.narrow(d, a - offsets[d], b - a)))
    return Sharded(shape, data.dtype, boxes)


def _shift(offsets: Offsets, first_expert: int) -> Offsets:
    """Local offsets -> global ones along dim 0 for a rank holding experts from ``first_expert``."""
    return (offsets[0] + first_expert, *offsets[1:]) if first_expert else offsets


def dtensor_box(tensor: DTensor, meta: ParamMeta | None = None) -> Sharded:
    """A DTensor's local shard (FSDP2: a run of rows, possibly empty) as a box of its global
    shape; for routed experts (sharded over edp) of the global shape of all experts, this ep
    rank's experts ``meta.expert_index()`` further along dim 0, and under expert tensor
    parallelism cut into this etp rank's runs along ``meta.tp_dim`` (FSDP shards dim 0 only)."""
    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local().detach()
    experts = meta.expert_index() if meta is not None and tensor.dim() else None
    runs = tp_runs(meta, writing=False) if tensor.dim() else None
    shape = tuple(meta.global_shape) if experts is not None or runs is not None else tuple(tensor.shape)
    offsets = _shift(tuple(offsets), int(experts[0])) if experts is not None else tuple(offsets)
    if not math.prod(sizes):
        return Sharded(shape, tensor.dtype, [])
    view = local.view(sizes)
    if runs is None:
        return Sharded(shape, tensor.dtype, [Box(offsets, view)])
    d = meta.tp_dim
    boxes = [Box((*offsets[:d], start, *offsets[d + 1 :]), view.narrow(d, local_start, length)) for local_start, start, length in runs]
    return Sharded(shape, tensor.dtype, boxes)


def cut_rows(sharded: Sharded, rows: int) -> Sharded:
    """``sharded`` as the first ``rows`` of its dim 0 only: a padded vocabulary's tokens. The
    padding depends on tp, so a checkpoint holds the tokens' rows alone and each layout reads
    those (its padded rows keep their initial values, which no result reads)."""
    boxes = [Box(b.offsets, b.data.narrow(0, 0, min(b.data.shape[0], rows - b.offsets[0]))) for b in sharded.boxes if b.offsets[0] < rows]
    return Sharded((rows, *sharded.shape[1:]), sharded.dtype, boxes)


def scalar(value: torch.Tensor, present: bool = True) -> Sharded:
    """A 0-d tensor (a step count, a loss-scaler field), held by this rank or not."""
    return Sharded((), value.dtype, [Box((), value.detach())] if present else [])


def nothing(like: torch.Tensor, meta: ParamMeta | None) -> Sharded:
    """A tensor this rank holds but does not write (another rank writes its replica)."""
    shape = tuple(meta.global_shape) if meta is not None and like.dim() else tuple(like.shape)
    return Sharded(shape, like.dtype, [])
