"""Muon's orthogonalization of many matrices at once: the blocks of equal shape of a run of
matrices stacked into one batch, so one batched Newton-Schulz serves them all.

Why: orthogonalized one block at a time (q / k / v, gate / up, each routed expert), each block
costs ~25 small kernels launched from Python, and the small blocks (a key or value block of a
1 B model is 512 x 2048) leave most of a GPU idle. Stacked, a run of matrices costs one
Newton-Schulz per block shape, whose batched GEMMs fill the GPU.

Each block is a set of rows of its matrix, either a contiguous run (``slice``: copied by views)
or scattered rows (an index tensor: ``index_select`` / ``index_copy_``). A stack of routed
experts ``[E, rows, cols]`` gives each block E matrices of the batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

# The most bytes of matrices orthogonalized together (a run of consecutive matrices): it bounds
# the stacked copies, the Newton-Schulz temporaries and, under tensor parallelism or FSDP2, the
# gathered whole matrices that exist at once. A matrix larger alone is a run of its own.
RUN_BYTES = 1 << 30

Rows = slice | torch.Tensor  # the rows of one block: a contiguous run, or their indices


def block_rows(parts: torch.Tensor) -> list[Rows]:
    """Each block's rows from the block number of every row (``parts``), a ``slice`` where contiguous."""
    blocks: list[Rows] = []
    for part in range(int(parts.max()) + 1):
        rows = (parts == part).nonzero().squeeze(1)
        first, last = int(rows[0]), int(rows[-1])
        blocks.append(slice(first, last + 1) if last - first + 1 == len(rows) else rows)
    return blocks


def runs(sizes: list[int], limit: int) -> list[range]:
    """Consecutive runs of items whose ``sizes`` sum to at most ``limit`` (an item over it alone)."""
    out, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            out.append(range(start, i))
            start, total = i, 0
        total += size
    if sizes:
        out.append(range(start, len(sizes)))
    return out


def row_count(rows: Rows, size: int) -> int:
    """How many of a matrix's ``size`` rows the block ``rows`` has."""
    return len(range(size)[rows]) if isinstance(rows, slice) else len(rows)


def orthogonalize_blocks(matrices: list[torch.Tensor], blocks: list[list[Rows] | None],
                         orthogonalize: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:  # fmt: skip
    """Each of ``matrices`` (``[..., rows, cols]``) with each of its ``blocks`` (None: the matrix is
    one) replaced by ``orthogonalize`` of it; ``orthogonalize`` maps a stack ``[n, rows, cols]`` to
    one of the same shape and is called once per block shape and dtype. A matrix of one block
    comes back as a view of its shape's result, the others as new tensors."""
    groups: dict[tuple[int, int, torch.dtype], list[tuple[int, Rows]]] = {}
    for i, (matrix, rows_of) in enumerate(zip(matrices, blocks, strict=True)):
        for rows in rows_of or [slice(None)]:
            groups.setdefault((row_count(rows, matrix.shape[-2]), matrix.shape[-1], matrix.dtype), []).append((i, rows))
    outs: list[torch.Tensor | None] = [None if rows_of is None else torch.empty_like(m) for m, rows_of in zip(matrices, blocks)]
    for (n_rows, cols, _), members in groups.items():
        shapes = [(*matrices[i].shape[:-2], n_rows, cols) for i, _ in members]
        starts = [0, *itertools.accumulate(math.prod(shape[:-2]) for shape in shapes)]
        stacked = matrices[members[0][0]].new_empty((starts[-1], n_rows, cols))
        for (i, rows), shape, start, end in zip(members, shapes, starts, starts[1:]):
            into = stacked[start:end].view(shape)
            if isinstance(rows, slice):
                into.copy_(matrices[i][..., rows, :])
            else:
                torch.index_select(matrices[i], -2, rows, out=into)
        result = orthogonalize(stacked)
        del stacked  # freed before the results are written out
        for (i, rows), shape, start, end in zip(members, shapes, starts, starts[1:]):
            piece = result[start:end].reshape(shape)  # a view: only a leading 1 is dropped
            if blocks[i] is None:
                outs[i] = piece
            elif isinstance(rows, slice):
                outs[i][..., rows, :].copy_(piece)
            else:
                outs[i].index_copy_(-2, rows, piece)
    return outs
