"""Whole weights of a parallel model, for tests that compare layouts with one process.

The checkpoint never gathers whole tensors (each rank writes its boxes); tests still want to
compare every weight with the one-process run, so they gather here: tp shards through
``plan.gather_full``, FSDP2 DTensors through ``full_tensor``, pipeline stages through an
``all_gather_object`` over pp (names are the one-process names on every stage).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtron.models.contract import ParamMeta
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import gather_full


@torch.no_grad()
def full_weights(model: nn.Module, metas: dict[str, ParamMeta], mesh: Mesh) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.state_dict()`` whole, on every rank (collective)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        elif name in metas:
            tensor = gather_full(tensor.detach(), metas[name], mesh)
        out[name] = tensor.detach().cpu().clone()
    if mesh.pp > 1:
        parts = [None] * mesh.pp
        dist.all_gather_object(parts, out, group=mesh.pp_group)
        out = {name: tensor for part in parts for name, tensor in part.items()}
    return out


@torch.no_grad()
def load_full_weights(full: dict[str, torch.Tensor], model: nn.Module, metas: dict[str, ParamMeta]) -> None:
    """Slice whole tensors into ``model``'s tensor-parallel layout (the inverse of ``full_weights`` at pp 1)."""
    local = {}
    for name, tensor in full.items():
        meta = metas.get(name)
        index = None if meta is None or meta.tp_size == 1 or tensor.dim() == 0 else meta.local_index()
        local[name] = tensor if index is None else tensor.index_select(meta.tp_dim, index)
    model.load_state_dict(local)
