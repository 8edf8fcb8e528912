"""FP8 under activation recompute: the rerun must cast with the scales the forward used.

Delayed scaling reads each operand's scale from an amax history that the forward itself then
updates. A checkpoint's recompute (in backward) would read the updated history — other scales,
so other FP8 copies than the ones the forward's GEMMs used (and, under expert parallelism, other
routing: another number of tokens per rank, which ``torch.utils.checkpoint`` reports as saved
tensors of another shape) — and would push its amaxes a second time. ``recompute_contexts`` is
the checkpoint's ``context_fn``: the forward snapshots the scaling states under the recomputed
modules; the recompute runs on that snapshot and then puts back the live state it found.
Current scaling (``tensorwise``, ``rowwise``) reads only the tensor and needs none of this.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn

from meshtron.kernels.fp8_scaling import Fp8Scaling


def recompute_contexts(modules: Iterable[nn.Module]) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward context, recompute context) for ``torch.utils.checkpoint``'s ``context_fn`` over
    ``modules``: nothing to do where they hold no delayed-scaling state."""
    scalings = [m for module in modules for m in module.modules() if isinstance(m, Fp8Scaling) and m.amax_history.numel()]
    if not scalings:
        return contextlib.nullcontext(), contextlib.nullcontext()
    snapshot: list[tuple[torch.Tensor, bool]] = []

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        snapshot.extend(_state(s) for s in scalings)
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        live = [_state(s) for s in scalings]
        _restore(scalings, snapshot)
        try:
            yield
        finally:
            _restore(scalings, live)

    return forward(), recompute()


def _state(scaling: Fp8Scaling) -> tuple[torch.Tensor, bool]:
    return scaling.amax_history.clone(), scaling.seeded


@torch.no_grad()
def _restore(scalings: list[Fp8Scaling], states: list[tuple[torch.Tensor, bool]]) -> None:
    for scaling, (history, seeded) in zip(scalings, states, strict=True):
        scaling.amax_history.copy_(history)
        scaling.seeded = seeded
