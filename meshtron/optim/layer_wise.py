"""The distributed optimizer for update rules that need whole matrices (``--use-distributed-optimizer``
with ``--optimizer muon`` or ``sgd``; Megatron-Core's layer-wise distributed optimizer).

Why not the flat ranges of ``distributed_optimizer.py``: those cut the buffer anywhere, through a
weight matrix too, and Muon orthogonalizes a matrix as a whole. Here each data-parallel rank owns
whole parameters instead: it keeps the fp32 masters and the rule's state of its own parameters
only (1/dp of the optimizer's memory, balanced by size), updates them from the all-reduced
gradients, then sends each updated parameter to the other ranks (one broadcast per parameter
from its owner). Gradients are all-reduced as with replicated masters (``GradBuffer`` not
sharded): every rank reads the whole gradient of what it owns.

Ownership is decided by size, largest first, each parameter going to the least-loaded rank of
the group its gradient is reduced over (dp x cp; edp for routed experts); every rank computes the
same assignment from the same buffer layout, the tp ranks of one matrix included (their shards
have equal sizes), so a matrix split over tp is owned by the same dp rank on every tp rank and
Muon's gather over tp finds all its shards. The grad norm sums each rank's owned gradients'
squares and completes them over that group, as the flat distributed optimizer does.

``state_dict`` / ``param_states`` hold this rank's own parameters (the sharded checkpoint writes
each whole from its owner and loads it back by name under any layout).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtron.optim.grad_buffer import GradBuffer
from meshtron.optim.optimizer import MixedPrecisionOptimizer, ParamState


def assign_owners(buf: GradBuffer) -> dict[nn.Parameter, tuple[dist.ProcessGroup | None, int]]:
    """``{param: (group, owner's rank in it)}``: largest first, each to the least-loaded rank of its
    gradient's group (ties to the lowest rank). Group None: a group of one, this rank owns it."""
    load: dict[int, list[int]] = {}
    owners = {}
    for param in sorted(buf.ranges, key=lambda p: (-p.numel(), buf.ranges[p][0])):
        group = buf.bucket_of(param).group
        if group is None:
            owners[param] = (None, 0)
            continue
        loads = load.setdefault(id(group), [0] * dist.get_world_size(group))
        owner = loads.index(min(loads))
        loads[owner] += param.numel()
        owners[param] = (group, owner)
    return owners


class LayerWiseOptimizer(MixedPrecisionOptimizer):
    """``MixedPrecisionOptimizer`` whose masters and state exist only for this rank's own whole
    parameters; after each step every parameter is broadcast from its owner."""

    def __init__(self, param_groups: list[dict[str, Any]], *, grads: GradBuffer, **kwargs: Any) -> None:
        if not isinstance(grads, GradBuffer) or grads.shard:
            raise ValueError("the layer-wise distributed optimizer needs a GradBuffer that all-reduces (shard=False)")
        self._owners = assign_owners(grads)
        super().__init__(param_groups, grads=grads, **kwargs)
        for key, groups in self._partial_norm_groups.items():  # each rank holds the gradients of its own params
            if grads.groups.get(key) is not None:
                groups.insert(0, grads.groups[key])

    def _owns(self, param: nn.Parameter) -> bool:
        group, owner = self._owners[param]
        return group is None or dist.get_rank(group) == owner

    def _build_masters(self, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        mine = [{**group, "params": [(n, p) for n, p in group["params"] if self._owns(p)]} for group in param_groups]
        return super()._build_masters(mine)

    @torch.no_grad()
    def _copy_masters_to_model(self) -> None:
        """The owners' masters into their params, then every param from its owner to the others."""
        super()._copy_masters_to_model()
        for param, (group, owner) in self._owners.items():
            if group is not None:
                dist.broadcast(param.data, src=dist.get_global_rank(group, owner), group=group)

    def param_states(self) -> list[ParamState]:
        """This rank's own parameters, whole (no other data-parallel rank holds their state)."""
        return [self._param_state(name, param, master, 0, False) for name, param, master in self._params]
