"""Host copies of a rank's checkpoint boxes, which an asynchronous save (``--async-save``) writes
from while training goes on.

Two things keep the training stall short:

- The pinned host buffers are allocated once, at start-up (``reserve``), and reused by every save
  of the run (same boxes, same shapes): page-locking tens of GB takes seconds, copying into locked
  pages does not. A run with ``--async-save`` therefore holds one host copy of its rank's
  checkpoint state.
- On a GPU the copies run on a side stream, ordered after the work that produced the state and
  not waited for on the host: the save returns as soon as they are enqueued. The state can only
  change in the next optimizer step, so ``before_state_changes()`` (called by the trainer just
  before it) makes the compute stream wait for the copies on the GPU; the next step's forward and
  backward overlap them. The writer thread waits for them on the host (the ``wait`` that
  ``stage`` returns) before it reads the buffers.

One save at a time: the caller completes the previous save (its writer is done with the buffers)
before staging the next, as the trainer does.
"""

from __future__ import annotations

from typing import Callable

import torch

from meshtron.checkpoint.boxes import Box, Sharded


class HostStaging:
    """Reusable host buffers for the boxes of a rank's checkpoint state, and the copy into them."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None
        self._copied: torch.cuda.Event | None = None  # the last copies, until the state may change
        self.allocated_bytes = 0  # host memory held for the run

    def stage(self, state: dict[str, Sharded]) -> tuple[dict[str, Sharded], Callable[[], None]]:
        """``state`` with every box replaced by its host buffer, and what blocks until the buffers
        hold it: the copies are enqueued on a GPU, done at once on the CPU (where training would
        otherwise overwrite the live tensors in place)."""
        on_gpu = any(box.data.is_cuda for sharded in state.values() for box in sharded.boxes)
        if not on_gpu:
            staged = {key: Sharded(s.shape, s.dtype, [Box(b.offsets, self._buffer(key, i, b.data).copy_(b.data))
                                                      for i, b in enumerate(s.boxes)]) for key, s in state.items()}  # fmt: skip
            return staged, lambda: None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())  # after the step that produced the state
        staged = {}
        with torch.cuda.stream(self._stream):
            for key, s in state.items():
                boxes = [Box(b.offsets, self._buffer(key, i, b.data).copy_(b.data, non_blocking=True)) for i, b in enumerate(s.boxes)]
                staged[key] = Sharded(s.shape, s.dtype, boxes)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._copied = copied
        return staged, copied.synchronize

    def reserve(self, state: dict[str, Sharded]) -> None:
        """Allocate the buffers of ``state``'s boxes now (at start-up), not in the first save."""
        for key, s in state.items():
            for i, box in enumerate(s.boxes):
                self._buffer(key, i, box.data)

    def before_state_changes(self) -> None:
        """Make the compute stream wait (on the GPU, not the host) for the copies of the last save."""
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)
            self._copied = None

    def _buffer(self, key: str, index: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get((key, index))
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            if buf is not None:
                self.allocated_bytes -= buf.numel() * buf.element_size()
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)
            self._buffers[(key, index)] = buf
            self.allocated_bytes += buf.numel() * buf.element_size()
        return buf
