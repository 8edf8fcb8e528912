"""Layout-free checkpoint state: the tensors one process of the same model would hold.

A checkpoint stores full tensors keyed by parameter name whatever tp / dp / FSDP layout wrote it,
so any layout loads it: resharding is slicing. The cost is a gather of the full state on each
save (collective over tp; the distributed optimizer gathers over dp itself). A sharded format can
replace these functions later without changing the callers in ``checkpoint.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshtron.models.contract import ParamMeta
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import gather_full, local_part

try:  # FSDP2 parameters are DTensors
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor, distribute_tensor


Metas = dict[str, ParamMeta] | None  # None: a one-process model, every tensor whole


def _full(tensor: torch.Tensor, meta: ParamMeta | None, mesh: Mesh) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    tensor = tensor.detach()
    return tensor if meta is None else gather_full(tensor, meta, mesh)


def _by_name(tree: Any, fn, name: str | None = None) -> Any:
    """Apply ``fn(tensor, parameter_name)`` to every tensor of a model or optimizer state dict,
    where the parameter name is the key under ``model`` / ``master`` / ``state``."""
    if isinstance(tree, dict):
        return {k: _by_name(v, fn, k if name is None else name) for k, v in tree.items()}
    return fn(tree, name) if isinstance(tree, torch.Tensor) else tree


@torch.no_grad()
def full_state(model: nn.Module, optimizer: Any, mesh: Mesh, with_optimizer: bool, metas: Metas = None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` with full tensors, put together from the shards the
    parameter records describe. Collective: every rank calls it."""
    metas = metas or {}
    state = {"model": {k: _full(v, metas.get(k), mesh) for k, v in model.state_dict().items()}}
    if with_optimizer:
        opt = optimizer.state_dict()
        state["optimizer"] = {
            "master": _by_name(opt["master"], lambda t, n: _full(t, metas.get(n), mesh)),
            "state": _by_name(opt["state"], lambda t, n: _full(t, metas.get(n), mesh)),
            "loss_scaler": opt["loss_scaler"],
        }
    return _merge_pipeline_stages(state, mesh)


def _merge_pipeline_stages(state: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """Give global rank 0 (the writer) every pipeline stage's tensors. Names are the one-process
    names on every stage, so merging is a dict update (a tied embedding's copies coincide)."""
    coords = mesh.coords()
    if mesh.pp == 1 or coords["tp"] or coords["cp"] or coords["dp"]:
        return state  # only the pipeline group of global rank 0 takes part
    cpu = _by_name(state, lambda t, _: t.cpu())
    parts = [None] * mesh.pp if mesh.rank == 0 else None
    torch.distributed.gather_object(cpu, parts, dst=0, group=mesh.pp_group)
    if mesh.rank != 0:
        return state
    merged = {"model": {}}
    for part in parts:
        merged["model"].update(part["model"])
        if "optimizer" in part:
            opt = merged.setdefault("optimizer", {"master": {}, "state": {}, "loss_scaler": part["optimizer"]["loss_scaler"]})
            opt["master"].update(part["optimizer"]["master"])
            opt["state"].update(part["optimizer"]["state"])
    return merged


@torch.no_grad()
def empty_full_state(model: nn.Module, optimizer: Any, with_optimizer: bool, metas: Metas = None) -> dict[str, Any]:
    """CPU tensors of the full shapes (and this run's dtypes) for DCP to load into."""
    metas = metas or {}

    def empty(t: torch.Tensor, name: str) -> torch.Tensor:
        meta = metas.get(name)
        whole = isinstance(t, DTensor) or meta is None or t.dim() == 0
        return torch.empty(list(t.shape) if whole else meta.global_shape, dtype=t.dtype, device="cpu")

    state = {"model": {k: empty(v, k) for k, v in model.state_dict().items()}}
    if with_optimizer:
        opt = optimizer.state_dict()
        state["optimizer"] = {key: _by_name(opt[key], empty) for key in ("master", "state", "loss_scaler")}
    return state


def _local(full: torch.Tensor, like: torch.Tensor, meta: ParamMeta | None) -> torch.Tensor:
    """This rank's part of ``full`` in the layout of ``like`` (a plain tensor, tp shard or DTensor)."""
    if isinstance(like, DTensor):
        return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return local_part(full, meta).to(like.device)


@torch.no_grad()
def load_full_state(full: dict[str, Any], model: nn.Module, optimizer: Any, with_optimizer: bool, metas: Metas = None) -> None:
    """Slice a loaded full state into this rank's model (and optimizer) in place."""
    metas = metas or {}
    live = model.state_dict()
    model.load_state_dict({k: _local(full["model"][k], live[k], metas.get(k)) for k in live})
    if with_optimizer:
        live_opt = optimizer.state_dict()
        local = {"loss_scaler": full["optimizer"]["loss_scaler"]}
        for key in ("master", "state"):
            saved = full["optimizer"][key]
            local[key] = {}
            for name, live_value in live_opt[key].items():
                if isinstance(live_value, dict):
                    local[key][name] = {k: _local(saved[name][k], v, metas.get(name)) for k, v in live_value.items()}
                else:
                    local[key][name] = _local(saved[name], live_value, metas.get(name))
        optimizer.load_state_dict(local)
