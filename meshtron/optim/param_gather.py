"""The distributed optimizer's parameter all-gather, at the end of the step or, with
``--overlap-param-gather``, hidden behind the next step's forward.

Why overlap: after the sharded step every rank holds only its slice of each bucket updated; the
all-gather that spreads the slices moves the model's bytes once per step. Waited at the end of
the step it is exposed communication; the next forward needs the buckets one after another (the
first layers first), so each bucket's gather can run while the layers before it compute.

How (Megatron-Core's ``start_param_sync`` / ``finish_param_sync`` with forward pre-hooks; it
dispatches each bucket when the one before is waited, here all go at once, as on NCCL they run one
after another on the group's stream either way): ``start`` launches one ``async_op`` all-gather per bucket, in forward
order (the gradient buffer lays buckets out in backward order, so reversed). A forward pre-hook
on every module that holds parameters of its own waits the buckets of those parameters, so the
first forward of each pipeline model chunk waits on its own. On NCCL a gather runs on the process
group's stream and ``wait()`` only makes the compute stream wait for it: the host launches the
whole forward at once and each bucket's gather overlaps the GEMMs of the layers before it. On
gloo it runs on the process group's thread (one flat tensor gathered in place, the form gloo
takes). Whatever reads the parameters outside a forward (a checkpoint save, the end of training,
the next step, a checkpoint load) calls ``finish`` first.

``start`` waits for an explicit call: the trainer makes it after the step's last collective on the
data-parallel group, as an NCCL collective queued behind the gathers would make the compute
stream wait for all of them. A pre-hook or ``finish`` that finds the gathers not started starts them.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from meshtron.optim.grad_buffer import GradBuffer, all_gather_single


class ParamGather:
    """Per bucket of ``buf`` (the distributed optimizer's gradient buffer), the in-place gather of
    ``param_flat`` (the model's params in the buffer's layout) from every rank's slice.

    ``wait_in``: the model (this rank's part) whose modules wait for their buckets in forward
    pre-hooks (``--overlap-param-gather``); None: the caller finishes the gathers itself.
    """

    def __init__(self, buf: GradBuffer, param_flat: torch.Tensor, wait_in: nn.Module | None = None) -> None:
        self._param_flat = param_flat
        # Forward order; a bucket no other rank holds (group None) has nothing to gather.
        self._buckets = [b for b in reversed(buf.buckets) if b.group is not None]
        self._shards = [buf.shard_range(b) for b in self._buckets]
        self._handles: list[object | None] = [None] * len(self._buckets)
        self._due = False  # a step wrote this rank's slices and their gathers are not launched yet
        if wait_in is not None:
            position = {id(b): i for i, b in enumerate(self._buckets)}
            bucket_of = {param: position.get(id(buf.bucket_of(param))) for param in buf.ranges}
            for module in wait_in.modules():
                needed = sorted({bucket_of[p] for p in module.parameters(recurse=False) if bucket_of.get(p) is not None})
                if needed:
                    module.register_forward_pre_hook(self._waiter(needed))

    def mark_due(self) -> None:
        """This rank's slices were written: their gathers are owed."""
        self._due = True

    @torch.no_grad()
    def start(self) -> None:
        """Launch every owed gather, asynchronously, in forward order; nothing when none is owed."""
        if not self._due:
            return
        self._due = False
        for i, (bucket, (lo, hi)) in enumerate(zip(self._buckets, self._shards)):
            out = self._param_flat[bucket.start : bucket.end]
            self._handles[i] = all_gather_single(out, self._param_flat[lo:hi], group=bucket.group, async_op=True)

    def wait(self, positions: Iterable[int]) -> None:
        """Make what runs next see the buckets at ``positions`` gathered (starting owed gathers)."""
        self.start()
        for i in positions:
            handle = self._handles[i]
            if handle is not None:
                handle.wait()
                self._handles[i] = None

    def finish(self) -> None:
        """Every bucket gathered."""
        self.wait(range(len(self._buckets)))

    def _waiter(self, positions: list[int]) -> Callable:
        def hook(module: nn.Module, args: object) -> None:
            if self._due or any(self._handles[i] is not None for i in positions):
                self.wait(positions)

        return hook
