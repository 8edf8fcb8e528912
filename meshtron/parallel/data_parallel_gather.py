"""The rows of one micro batch from every data-parallel rank, differentiably: the parallel module
of the contract's ``GatherOverDataParallel`` (the retriever's in-batch negatives span the
data-parallel micro batch).

Backward all-reduces the gradient of the gathered rows and keeps this rank's slice: every rank's
loss reads every rank's rows, so the gradient of a rank's rows is the sum of all the losses'
gradients for them. With the runner's dp-summed parameter gradients (each rank's loss divided by
the global count) this is the one-process gradient of the concatenated batch. An all-reduce of
``[dp * b, d]`` embeddings rather than a reduce-scatter: it costs nothing at these sizes and gloo
has it, so the CPU equivalence tests run the same code as NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, rank, size
        parts = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(parts, rows.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(ctx.size)[ctx.rank], None, None, None


class DataParallelRowGather(nn.Module):
    """``rows [b, ...] -> (every dp rank's rows [dp * b, ...] in rank order, this rank's first row)``.
    Every rank's micro batch holds ``b`` samples (the sampler's equal slices)."""

    def __init__(self, group, rank: int, size: int):
        super().__init__()
        self.group, self.rank, self.size = group, rank, size

    def forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        return _GatherRows.apply(rows, self.group, self.rank, self.size), self.rank * rows.shape[0]
