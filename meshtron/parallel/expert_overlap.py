"""The expert-parallel all-to-all hidden behind the experts' computation
(``--overlap-moe-expert-parallel-comm``, the alltoall dispatcher).

Without it, a layer's rows travel to their experts in one all-to-all, the experts compute, and one
all-to-all brings the outputs back: the GPU idles through both. Here each rank's local experts are
cut into chunks of consecutive experts (``--model.moe_ep_overlap_chunks``) and every rank sends,
chunk by chunk, the rows of that chunk's experts on each destination, so the exchange pipelines:

    forward   dispatch 0 | dispatch 1 under chunk 0's experts | combine 0 under chunk 1's | combine 1
    backward  the mirror: chunk 0's combine gradient under chunk 1's experts' backward, chunk 1's
              dispatch gradient under chunk 0's

Each all-to-all is launched (``async_op=True``: on NCCL its own stream) by one autograd function,
``_Launch``, and waited for by another, ``_Land``, where its rows are first needed; the compute
stream waits for nothing before then. In backward the roles swap: ``_Land``'s backward launches the
gradient's all-to-all and ``_Launch``'s backward waits for it. Autograd runs the ready node created
last first, so the backward visits the chunks in the reverse of the forward's order and one
chunk's experts' backward runs between another chunk's launch and wait (tests check the order).
With ``C`` chunks the first dispatch and the last combine stay exposed: about 2 / C of the
all-to-all's time in each direction, less where a chunk's computation is shorter than its transfer.
The layer's shared experts (``beside``) are enqueued right after the first dispatch is launched,
so they compute while it travels; autograd reaches their backward after chunk 0's experts', while
chunk 0's dispatch gradient travels back. Only the last combine (forward) and its gradient
(backward) then wait alone.

Megatron-Core's flag of the same name overlaps one micro batch's all-to-all with another micro
batch's computation (its combined 1F1B schedule); this one stays inside a layer and a micro batch,
so it composes with every pipeline schedule, recompute and the zero-bubble weight-gradient split.

Every expert gets the same rows in the same order as in one exchange, and its weight gradient is
computed in one piece (a chunk's experts are a slice of the stacked weights), so the results are
bit-identical to the unchunked exchange. With gradient-accumulation fusion each chunk writes its
slice of ``main_grad``; ``_ChunkReports`` makes the chunks one weight for the gradient buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def runs_in_order(sizes: torch.Tensor, order: torch.Tensor, total: int) -> torch.Tensor:
    """Row index that reorders a buffer of consecutive runs (``sizes``, ``total`` rows) into the
    runs' ``order``: ``buffer[index]`` holds run ``order[0]``'s rows, then ``order[1]``'s, ..."""
    starts = torch.cumsum(sizes, 0) - sizes
    run_sizes, run_starts = sizes[order], starts[order]
    new_starts = torch.cumsum(run_sizes, 0) - run_sizes
    offset_in_run = torch.arange(total, device=sizes.device) - torch.repeat_interleave(new_starts, run_sizes, output_size=total)
    return torch.repeat_interleave(run_starts, run_sizes, output_size=total) + offset_in_run


def unpermute_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows`` = ``buffer.index_select(0, index)`` for a permutation ``index`` -> ``buffer``'s order:
    each row written back to its place (no sort of the index to invert it; the gradient is one
    gather, where that of ``index_select`` zero-fills and adds)."""
    return torch.empty_like(rows).index_copy_(0, index, rows)


class _InFlight:
    """One all-to-all: ``send[j]`` rows to rank j, ``recv[i]`` from rank i; while it (or its
    gradient's way back) runs, its work and the buffer it fills."""

    def __init__(self, send: list[int], recv: list[int], group) -> None:
        self.send, self.recv, self.group, self.work, self.out = send, recv, group, None, None

    def launch(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        self.out = x.new_empty((sum(recv), *x.shape[1:]))
        self.work = dist.all_to_all_single(self.out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                                           group=self.group, async_op=True)  # fmt: skip
        return self.out

    def wait(self) -> torch.Tensor:
        """The filled buffer; on NCCL the current stream waits for it, the host does not."""
        self.work.wait()
        out, self.work, self.out = self.out, None, None
        return out


class _Launch(torch.autograd.Function):
    """Starts ``flight``'s all-to-all of ``x``; the rows it returns are valid after ``_Land``.
    Backward: waits for the gradient's all-to-all that ``_Land``'s backward started, and returns
    what it brought."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        ctx.flight = flight
        return flight.launch(x, flight.send, flight.recv)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return ctx.flight.wait(), None


class _Land(torch.autograd.Function):
    """Waits for ``flight``'s all-to-all into ``rows``. Backward: starts the gradient's way back
    (the gradient itself passes through to ``_Launch``, which waits for the result)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        ctx.flight = flight
        flight.wait()
        return rows

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.flight.launch(grad, ctx.flight.recv, ctx.flight.send)
        return grad, None


def chunk_bounds(num_local: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` runs of consecutive local experts, as even as they divide: [(first, end)]."""
    return [(c * num_local // chunks, (c + 1) * num_local // chunks) for c in range(chunks)]


@torch.compiler.disable  # a graph break, as the plain exchange's host sync is: runs eagerly inside a compiled block
def exchange_in_chunks(x: torch.Tensor, sent: torch.Tensor, received: torch.Tensor, bounds: list[tuple[int, int]],
                       compute: Callable[[torch.Tensor, int], torch.Tensor], group,
                       beside: Callable[[], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``x`` [R, h], rows grouped by global expert, ``sent[j, l]`` of them for rank j's local expert
    l, sent to their experts and their outputs brought back, chunk by chunk (``bounds``: local
    experts per chunk) -> (outputs [R, h] in x's rows, ``beside()``). ``received[i, l]``: rows rank
    i sends to this rank's expert l. ``compute(rows, c)``: outputs of chunk c's arrived rows,
    ordered [source rank][local expert of the chunk]. ``beside`` (the shared experts) runs while
    the first chunk's rows travel; its backward falls while the first chunk's gradient travels back."""
    ep, local = sent.shape
    host_sent, host_received = torch.stack([sent, received]).tolist()  # the one host sync: split sizes
    grid = torch.arange(ep * local, device=x.device).view(ep, local)
    order = torch.cat([grid[:, lo:hi].reshape(-1) for lo, hi in bounds])  # runs [chunk][destination][expert]
    index = runs_in_order(sent.reshape(-1), order, x.shape[0])
    flights = [_InFlight([sum(row[lo:hi]) for row in host_sent], [sum(row[lo:hi]) for row in host_received], group)
               for lo, hi in bounds]  # fmt: skip
    pieces = torch.split(x.index_select(0, index), [sum(f.send) for f in flights])
    arriving, returning = _Launch.apply(pieces[0], flights[0]), []
    side = beside() if beside is not None else None
    for c, flight in enumerate(flights):
        following = _Launch.apply(pieces[c + 1], flights[c + 1]) if c + 1 < len(flights) else None
        back = _InFlight(flight.recv, flight.send, group)
        returning.append((_Launch.apply(compute(_Land.apply(arriving, flight), c), back), back))
        arriving = following
    out = torch.cat([_Land.apply(rows, back) for rows, back in returning])
    return unpermute_rows(out, index), side


class _ChunkReports:
    """The gradient buffer as the chunks of one expert weight see it under gradient-accumulation
    fusion (``kernels/deferred_wgrad``): each chunk writes its own experts' rows of ``main_grad``,
    so the step's first write, asked of the buffer once, holds for every chunk; the weight is
    reported to the buffer once, when its last chunk's gradient is in."""

    def __init__(self, param: torch.Tensor, chunks: int) -> None:
        self.param, self.buffer, self.left, self.first = param, param.grad_buffer, chunks, None

    def take_first_write(self, _chunk: torch.Tensor) -> bool:
        if self.first is None:
            self.first = self.buffer.take_first_write(self.param)
        return self.first

    def grad_deferred(self, _chunk: torch.Tensor) -> None:
        self.buffer.grad_deferred(self.param)

    def fused_grad_ready(self, _chunk: torch.Tensor) -> None:
        self._count(self.buffer.fused_grad_ready)

    def grad_landed(self, _chunk: torch.Tensor) -> None:
        self._count(self.buffer.grad_landed)

    def _count(self, report: Callable[[torch.Tensor], None]) -> None:
        self.left -= 1
        if self.left == 0:
            report(self.param)


def weight_chunks(param: torch.Tensor, bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of the stacked expert weight ``param`` [L, ...], one per chunk of experts; where the
    fused weight gradient goes into ``param.main_grad``, each view carries its slice of it and a
    ``_ChunkReports`` as its gradient buffer."""
    views = [param[lo:hi] for lo, hi in bounds]
    if hasattr(param, "main_grad") and hasattr(param, "grad_buffer"):
        reports = _ChunkReports(param, len(bounds))
        for view, (lo, hi) in zip(views, bounds):
            view.main_grad, view.grad_buffer = param.main_grad[lo:hi], reports
    return views
