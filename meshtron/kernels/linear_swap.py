"""Replace the plain ``nn.Linear`` layers of a module tree by a subclass holding the same
parameters: how FP8 linears and gradient-accumulation fusion enter a model (module replacement,
as the parallel plan does, never a class assignment on a live module)."""

from __future__ import annotations

from typing import Callable, TypeVar

from torch import nn

L = TypeVar("L", bound=nn.Linear)


def with_parameters_of(cls: type[L], linear: nn.Linear) -> L:
    """A ``cls`` sharing ``linear``'s weight and bias (the very Parameter objects: names, state
    dict, optimizer and gradient buffer see no change), built without allocating any storage."""
    new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    new.weight, new.bias = linear.weight, linear.bias
    new.train(linear.training)
    return new


def replace_linears(root: nn.Module, make: Callable[[nn.Linear], nn.Module], keep: Callable[[nn.Linear], bool] = lambda _: True) -> int:
    """Put ``make(linear)`` in the place of every plain ``nn.Linear`` under ``root`` for which
    ``keep`` holds; returns how many were replaced."""
    found = [(name, m) for name, m in root.named_modules() if type(m) is nn.Linear and keep(m)]
    for name, linear in found:
        parent, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, child, make(linear))
    return len(found)
