"""Weight gradients taken out of backward, to run later: the zero-bubble pipeline schedules' ``W``.

A zero-bubble schedule (``pipeline_schedules``: ``zb-h1``, ``zbv``) splits a stage's backward in
two: ``B``, the gradient of the stage's input, which the previous stage waits for, and ``W``, the
weight gradients, which nobody waits for and which the schedule runs where the rank would
otherwise idle. The split is made where a weight gradient is a GEMM of its own: the linear
functions whose weight gradient goes into ``main_grad`` (``grad_accum_fusion``: the plain, FP8 and
tensor-parallel linears and the tp-overlap ones; the MoE grouped GEMMs) ask ``deferring()`` in
their backward, and inside a ``WeightGradStore.record`` they hand the GEMM here, with the operands
it would have read (the saved input, the output gradient), instead of running it. ``run`` later
runs exactly that GEMM into ``main_grad``. Every other gradient (norms, biases, embeddings,
routers, a tied output layer) is computed in ``B`` as usual, so the split is exact
whichever layers the model has; ``W`` just has less to do.

Why not autograd's own split (``torch.autograd.grad`` on the stage's inputs with the graph kept,
then again on the weights): a function that writes its weight gradient as a side effect (the
fused linears) would do so in both passes, and a checkpointed block's recompute would run twice.

The gradient buffer sees the weight's gradient land in ``W``: the hook autograd still runs for
the weight in ``B`` (with no gradient) is told to pass (``GradBuffer.grad_deferred``) and ``W``
reports the gradient (``GradBuffer.grad_landed``), so a bucket's reduction starts once its last
weight gradient is in, as without the split. What ``W`` keeps alive until it runs (each layer's
input and output gradient) is the memory the schedules budget for.

The recording store is module state, not thread-local: on a GPU, autograd runs backward on a
device thread of its own while the caller waits.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Hashable, Iterator

import torch

# compute(overwrite): the gradient written into param.main_grad (overwrite) or added to it
Deferred = tuple[torch.Tensor, Callable[[bool], None]]

_recording: list[Deferred] | None = None


def deferring() -> bool:
    """Whether a backward now running is a split backward's ``B`` (weight gradients wait)."""
    return _recording is not None


def defer(param: torch.Tensor, compute: Callable[[bool], None]) -> None:
    """Keep ``param``'s weight-gradient GEMM for ``W``: ``compute(overwrite)`` writes it into
    ``param.main_grad`` (``overwrite``: the step's first) or adds it there."""
    assert _recording is not None, "defer() outside WeightGradStore.record()"
    _recording.append((param, compute))
    param.grad_buffer.grad_deferred(param)


class WeightGradStore:
    """The deferred weight gradients of one schedule run, by key (micro batch, local chunk)."""

    def __init__(self) -> None:
        self.pending: dict[Hashable, list[Deferred]] = {}

    @contextlib.contextmanager
    def record(self, key: Hashable) -> Iterator[None]:
        """The backward run inside is a ``B``: the weight gradients it defers wait under ``key``."""
        global _recording
        if _recording is not None:
            raise RuntimeError("a split backward is already recording its weight gradients")
        _recording = self.pending.setdefault(key, [])
        try:
            yield
        finally:
            _recording = None

    @torch.no_grad()
    def run(self, key: Hashable) -> None:
        """``W``: the weight gradients recorded under ``key``, into ``main_grad``, each reported to
        its gradient buffer as landed."""
        for param, compute in self.pending.pop(key, []):
            buffer = param.grad_buffer
            compute(buffer.take_first_write(param))
            buffer.grad_landed(param)

    def check_empty(self) -> None:
        if self.pending:
            raise RuntimeError(f"weight gradients of {sorted(self.pending)} were deferred but never run: the schedule lacks their W")


def defer_or_run(param: torch.Tensor, compute: Callable[[bool], None]) -> None:
    """``param``'s weight gradient into its ``main_grad``: deferred to ``W`` inside a split
    backward's ``B``, else now (written if it is the step's first, else added), reported to its
    buffer as a fused gradient."""
    if deferring():
        defer(param, compute)
        return
    buffer: Any = param.grad_buffer
    compute(buffer.take_first_write(param))
    buffer.fused_grad_ready(param)
