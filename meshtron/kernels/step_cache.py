"""Values derived from parameters (their FP8 copies) kept over one step's micro batches.

Why: FP8 linears and the FP8 experts cast every weight before their GEMMs; with several micro
batches a step (gradient accumulation) the same weights would be cast again for each (at a few
hundred rows per expert the cast costs about what the FP8 GEMMs save). Inside ``scope()`` a value
is made once per parameter and reused by later micro batches and by recomputed forwards.

The runner opens the scope around one step's forward and backward passes of several micro batches,
where no parameter changes; outside it nothing is kept (and nothing outlives it). Only
``nn.Parameter`` objects are keys, held by the cache itself: a view or a temporary copy of a
weight is never matched to another tensor that happens to reuse its memory.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn

T = TypeVar("T")
_kept: dict[tuple[int, str], tuple[nn.Parameter, Any]] | None = None


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Keep derived values until the block ends (a scope inside another shares the outer one's)."""
    global _kept
    outer = _kept
    _kept = {} if outer is None else outer
    try:
        yield
    finally:
        _kept = outer


def keeps(param: torch.Tensor) -> bool:
    """Whether ``derived`` keeps values of ``param`` here: inside a scope, for a parameter itself."""
    return _kept is not None and isinstance(param, nn.Parameter)


def derived(param: torch.Tensor, what: str, make: Callable[[], T]) -> T:
    """``make()``, made once per ``(param, what)`` inside a scope (see ``keeps``), else every call."""
    if not keeps(param):
        return make()
    key = (id(param), what)  # the entry holds ``param``, so its id is not reused while the scope lasts
    if key not in _kept:
        _kept[key] = (param, make())
    return _kept[key][1]
