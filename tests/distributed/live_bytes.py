"""Live tensor bytes on the CPU, where no allocator counts them: ``with LiveBytes() as live: ...``
counts every storage an op run under it allocates, from its allocation until it is freed."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``live``: bytes of the storages allocated under the mode and not yet freed; ``peak``: the
    most at once. A view or an in-place op's output shares a storage it was given: not counted."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in given | self.sizes.keys():
                storage = t.untyped_storage()
                self.sizes[storage._cdata] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, storage._cdata)
        return out

    def _freed(self, key: int) -> None:
        self.live -= self.sizes.pop(key)
