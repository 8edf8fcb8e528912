"""The checkpoint's tensors, as this rank's boxes of the one-process tensors (``boxes.py``).

Keys are the one-process names, the same under every layout::

    model.{param}                               the model's weights, in its dtype
    optimizer.master.{param}                    fp32 masters (saved in fp32 mode too)
    optimizer.state.{param}.exp_avg / .exp_avg_sq   Adam moments, in the parameter's shape
    optimizer.state.{param}.step                0-d
    optimizer.loss_scaler.{field}               0-d float64

Who writes what, so that every element is written once and no rank stages more than it holds:

- a tensor replicated over tp (not split there) and over the group its gradient is reduced over
  (``ParamMeta.grad_group``: dp x cp for dense weights) is written by one rank of those copies,
  chosen round-robin by the parameter's position in the sorted names, so the ranks share the work;
- tensor-parallel shards by each tp rank (k/v rows several tp ranks copy: by the counted copy);
- the distributed optimizer's masters and moments by the data-parallel rank owning each slice,
  and FSDP2's DTensor shards by the rank holding them;
- a tied embedding's second pipeline copy (``pipeline_copy == "other"``) not at all;
- a parameter's ``step`` by the rank writing the first element of its master; the loss scaler
  by global rank 0.

Loading builds the same keys with every box this rank *holds* (replicas included) and lets DCP
fill them in place, whatever layout wrote the checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshtron.checkpoint.boxes import Sharded, cut_rows, nothing, param_boxes, scalar
from meshtron.models.contract import ParamMeta
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.plan import vocabulary_rows

Metas = dict[str, ParamMeta] | None  # None: a one-process model, every tensor whole
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _writes(meta: ParamMeta | None, position: int, mesh: Mesh, dp_replicated: bool) -> bool:
    """Whether this rank writes its copy of a parameter-shaped tensor. Copies exist over tp (etp
    for routed experts, ``ParamMeta.split_over``) when the tensor is not split there, and over its gradient group when ``dp_replicated``; the
    parameter's ``position`` picks one rank of that grid of copies (round-robin, so the ranks
    share the writing)."""
    if meta is not None and meta.pipeline_copy == "other":
        return False
    copies = [] if meta is not None and meta.tp_dim is not None else [meta.split_over if meta is not None else "tp"]
    if dp_replicated:
        copies.append(meta.grad_group if meta is not None else "dp_cp")
    coords = mesh.coords()
    for dim in copies:
        if coords[dim] != position % mesh.size(dim):
            return False
        position //= mesh.size(dim)
    return True


@torch.no_grad()
def save_state(model: nn.Module, optimizer: Any, mesh: Mesh, with_optimizer: bool, metas: Metas = None) -> dict[str, Sharded]:
    """``{key: Sharded}`` of the boxes this rank writes, views of the live tensors (no copy)."""
    metas, tokens = metas or {}, vocabulary_rows(model)
    live = model.state_dict()
    position = {name: i for i, name in enumerate(sorted(live))}
    state = {}
    for name, tensor in live.items():
        meta = metas.get(name)
        writes = _writes(meta, position[name], mesh, dp_replicated=not _is_dtensor(tensor))
        sharded = param_boxes(tensor, tuple(tensor.shape), meta, writing=True) if writes else nothing(tensor, meta)
        state[f"model.{name}"] = _tokens_only(sharded, name, tokens)
    if with_optimizer:
        for ps in optimizer.param_states():
            meta = metas.get(ps.name)
            writes = _writes(meta, position[ps.name], mesh, ps.dp_replicated)
            for key, tensor in ps.tensors.items():
                sharded = param_boxes(tensor, ps.shape, meta, ps.start, writing=True) if writes else nothing(tensor, meta)
                state[_optimizer_key(ps.name, key)] = _tokens_only(sharded, ps.name, tokens)
            holds_origin = any(not any(b.offsets) for b in state[_optimizer_key(ps.name, "master")].boxes)
            state[_optimizer_key(ps.name, "step")] = scalar(ps.step, present=holds_origin)
        for field, value in _scaler_tensors(optimizer).items():
            state[f"optimizer.loss_scaler.{field}"] = scalar(value, present=mesh.rank == 0)
    return state


def _tokens_only(sharded: Sharded, name: str, tokens: dict[str, int]) -> Sharded:
    """A padded vocabulary's tensor cut to its tokens' rows (``vocabulary_rows``): the stored shape
    is then the same under every tp, whose padding differs."""
    return cut_rows(sharded, tokens[name]) if name in tokens else sharded


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """An FSDP2 parameter: each data-parallel rank holds (and writes) its own shard."""
    return hasattr(tensor, "device_mesh")


def _optimizer_key(name: str, key: str) -> str:
    return f"optimizer.master.{name}" if key == "master" else f"optimizer.state.{name}.{key}"


def _scaler_tensors(optimizer: Any) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(float(v), dtype=torch.float64) for k, v in optimizer.loss_scaler.state_dict().items()}


@torch.no_grad()
def load_state(model: nn.Module, optimizer: Any, with_optimizer: bool, metas: Metas = None) -> dict[str, Sharded]:
    """``{key: Sharded}`` of every box this rank holds, views into the live tensors for DCP to
    fill in place; the loss scaler's fields are fresh 0-d tensors (``finish_load`` applies them)."""
    metas, tokens = metas or {}, vocabulary_rows(model)
    state = {f"model.{name}": _tokens_only(param_boxes(t, tuple(t.shape), metas.get(name)), name, tokens)
             for name, t in model.state_dict().items()}  # fmt: skip
    if with_optimizer:
        for ps in optimizer.param_states():
            for key, tensor in ps.tensors.items():
                state[_optimizer_key(ps.name, key)] = _tokens_only(param_boxes(tensor, ps.shape, metas.get(ps.name), ps.start), ps.name, tokens)
            state[_optimizer_key(ps.name, "step")] = scalar(ps.step)
        for field, value in _scaler_tensors(optimizer).items():
            state[f"optimizer.loss_scaler.{field}"] = scalar(value)
    return state


def finish_load(state: dict[str, Sharded], optimizer: Any) -> None:
    """After DCP filled ``load_state``'s boxes: the optimizer takes its loss scaler's fields and
    writes its masters into the model (collective over dp for the distributed optimizer)."""
    prefix = "optimizer.loss_scaler."
    optimizer.finish_load({k[len(prefix) :]: s.boxes[0].data.item() for k, s in state.items() if k.startswith(prefix)})


def state_bytes(state: dict[str, Sharded]) -> int:
    """Bytes of the boxes in ``state`` (what a save hands DCP, or stages to host)."""
    return sum(s.nbytes() for s in state.values())
