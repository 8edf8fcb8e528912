"""Apply a model family's parallel plan: the one way tensor, sequence, context and expert
parallelism (and a loss's view of the data-parallel batch) enter a model.

Every rank builds the same full model (on the meta device in training: shapes only, so shards are
slices of nothing until ``models.init.materialize`` draws them), then ``parallelize`` walks
``model.parallel_plan()`` and replaces each matched module by the parallel module of its style,
holding this rank's shard (module replacement is the only
mechanism: no class swaps of the model, no hooks, no methods patched on instances). It returns
one ``ParamMeta`` per parameter name: the global shape, which dim is split and how, whether its
gradient is a partial sum over tp. That record, not attributes on the parameters, is what the
optimizer, the gradient buffers and the checkpoint read.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from meshtron.errors import ConfigError
from meshtron.models import contract as mc
from meshtron.models.sizes import styled_modules
from meshtron.parallel.context_parallel import ContextParallelAttention
from meshtron.parallel.data_parallel_gather import DataParallelRowGather
from meshtron.parallel.expert_parallel import ExpertParallelExperts, experts_communicate, expert_tensor_parallel_split
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.sequence_sum import SequenceShardSum
from meshtron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    HeadShardSum,
    RowParallelLinear,
    SequenceParallelFirstToken,
    SequenceScatterEmbedding,
    TensorParallelEntry,
    VocabParallelEmbedding,
    VocabParallelOutputLayer,
)
from meshtron.parallel.tp_overlap import resolve_backend

ParamMetas = dict[str, mc.ParamMeta]


def vocabulary_rows(model: nn.Module) -> dict[str, int]:
    """``{parameter name: tokens}`` for each parameter whose dim 0 is a padded vocabulary (the
    modules the plan splits by vocabulary, when the model's ``padded_vocab_size`` exceeds its
    ``vocab_size``): what a checkpoint cuts to the tokens, so any tp loads it. Empty without padding."""
    tokens, rows = getattr(model, "vocab_size", 0), getattr(model, "padded_vocab_size", 0)
    if not tokens or rows <= tokens:
        return {}
    vocab_styles = (mc.VocabParallelEmbedding, mc.VocabParallelOutput)
    return {f"{name}.{pname}": tokens for name, style in styled_modules(model, model.parallel_plan()).items()
            if isinstance(style, vocab_styles) for pname, _ in model.get_submodule(name).named_parameters()}  # fmt: skip


def parallelize(model: mc.ModelFamily, mesh: Mesh, sequence_parallel: bool = False, cp_algorithm: str = "p2p",
                cp_block_kernel: str = "auto", tp_comm_overlap: str = "") -> ParamMetas:  # fmt: skip
    """Shard ``model`` (the full model, identical on every rank) over ``mesh.tp`` and route its
    core attention over ``mesh.cp``, in place, by its plan; returns its parameters' records.

    With ``sequence_parallel`` the residual stream between tensor-parallel regions holds 1/tp of
    the tokens on each rank; ``tp_comm_overlap`` (a ``tp_overlap`` backend, "" for none) then
    pipelines the column and row linears' gathers and reduce-scatters with their GEMMs. At
    tp = cp = 1 nothing is replaced (the records are still returned).
    """
    # A parameter no style touches is whole on every tp rank: its tp position makes the grad
    # norm count it once (on tp rank 0), not once per rank.
    whole = dict(tp_size=mesh.tp, tp_rank=mesh.tp_rank)
    metas = {name: dataclasses.replace(mc.default_meta(name, p), **whole) for name, p in model.named_parameters()}
    linear_weights = [f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear) and name]
    for name in linear_weights:  # Muon's matrices; found before any module is replaced
        metas[name] = dataclasses.replace(metas[name], matrix=True)
    sp = sequence_parallel and mesh.tp > 1
    overlap = resolve_backend(tp_comm_overlap, mesh.tp_group) if tp_comm_overlap and sp else ""
    for name, style in styled_modules(model, model.parallel_plan()).items():
        module = model.get_submodule(name)
        replacement = _replace(module, style, mesh, sp, cp_algorithm, cp_block_kernel, overlap)
        if replacement is not None:
            _set_submodule(model, name, replacement)
        for pname, _ in (replacement or module).named_parameters():
            full = f"{name}.{pname}"
            metas[full] = _meta(metas[full], style, pname, mesh, sp)
    return metas


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _replace(module: nn.Module, style: mc.Style, mesh: Mesh, sp: bool, cp_algorithm: str,
             cp_block_kernel: str, overlap: str) -> nn.Module | None:  # fmt: skip
    """The module taking ``module``'s place under ``style``, or None when it stays."""
    tp = mesh.tp
    if isinstance(style, mc.ContextParallelCore):
        return ContextParallelAttention(mesh, cp_algorithm, cp_block_kernel, getattr(module, "scale", None)) if mesh.cp > 1 else None
    if isinstance(style, mc.ExpertParallel):
        return ExpertParallelExperts(module, mesh, style.dispatcher, style.fc1_layout, sp, style.overlap_chunks) if experts_communicate(mesh, sp) else None
    if isinstance(style, mc.SequenceSum):
        over_tp = sp and style.over_tp
        if not (over_tp or mesh.cp > 1):
            return None
        return SequenceShardSum(mesh.tp_group if over_tp else None, mesh.cp_group if mesh.cp > 1 else None)
    if isinstance(style, mc.GatherOverDataParallel):
        return DataParallelRowGather(mesh.dp_group, mesh.dp_rank, mesh.dp) if mesh.dp > 1 else None
    if tp == 1:
        return None
    if isinstance(style, mc.EnterTensorParallel):
        return TensorParallelEntry(mesh.tp_group, sp)
    if isinstance(style, (mc.ColumnParallel, mc.RowParallel)):
        return _linear(module, style, mesh, sp, overlap)
    if isinstance(style, mc.VocabParallelEmbedding):
        return _copy_weight(VocabParallelEmbedding(*module.weight.shape, mesh.tp_group, sp, device=module.weight.device,
                                                   dtype=module.weight.dtype), module, 0, mc.Contiguous(), tp, mesh.tp_rank)  # fmt: skip
    if isinstance(style, mc.VocabParallelOutput):
        out = VocabParallelOutputLayer(mesh.tp_group, sp, module.fused_kernels, module.vocab_size, module.weight_reused)
        for name in ("weight", "bias"):  # each when the layer has its own
            full = getattr(module, name)
            if full is not None:
                setattr(out, name, nn.Parameter(_shard(full, 0, mc.Contiguous(), tp, mesh.tp_rank), full.requires_grad))
        return out
    if isinstance(style, mc.HeadParallelTable):  # sliced in place: the module stays
        if not style.layout.divisible(module.weight.shape[style.dim], tp):
            raise ConfigError(f"{module.weight.shape[style.dim]}-wide per-head weights do not split over --tensor-model-parallel-size {tp}; "
                              "change tp")  # fmt: skip
        module.weight = nn.Parameter(_shard(module.weight, style.dim, style.layout, tp, mesh.tp_rank), module.weight.requires_grad)
        return None
    if isinstance(style, mc.SumOverHeadShards):
        return HeadShardSum(mesh.tp_group, max(1, tp // style.heads))
    if isinstance(style, mc.ScatterToSequence):
        return SequenceScatterEmbedding(module, mesh.tp_group) if sp else None
    if isinstance(style, mc.FirstTokenOfSequence):
        return SequenceParallelFirstToken(mesh.tp_group) if sp else None
    return None  # SequenceParallelNorm, SharedByHeads: the module stays, only its records change


@torch.no_grad()
def _shard(full: torch.Tensor, dim: int, layout: mc.Layout, tp: int, rank: int) -> torch.Tensor:
    index = layout.local_index(full.shape[dim], tp, rank).to(full.device)
    return full.index_select(dim, index)  # a new tensor already: no copy beyond the shard


@torch.no_grad()
def _copy_weight(new: nn.Module, old: nn.Module, dim: int, layout: mc.Layout, tp: int, rank: int) -> nn.Module:
    new.weight.copy_(_shard(old.weight, dim, layout, tp, rank))
    new.weight.requires_grad_(old.weight.requires_grad)
    return new


@torch.no_grad()
def _linear(linear: nn.Linear, style: mc.ColumnParallel | mc.RowParallel, mesh: Mesh, sp: bool, overlap: str) -> nn.Module:
    tp, rank, w = mesh.tp, mesh.tp_rank, linear.weight
    column = isinstance(style, mc.ColumnParallel)
    size = w.shape[0] if column else w.shape[1]
    if not style.layout.divisible(size, tp):
        raise ConfigError(f"a {size}-wide layer does not split over --tensor-model-parallel-size {tp}; change tp")
    local = len(style.layout.local_index(size, tp, rank))
    cls = ColumnParallelLinear if column else RowParallelLinear
    shape = (w.shape[1], local) if column else (local, w.shape[0])
    out = cls(*shape, linear.bias is not None, mesh.tp_group, sp, device=w.device, dtype=w.dtype)
    out.comm_overlap = overlap
    _copy_weight(out, linear, 0 if column else 1, style.layout, tp, rank)
    if linear.bias is not None:
        out.bias.copy_(_shard(linear.bias, 0, style.layout, tp, rank) if column else linear.bias)
        out.bias.requires_grad_(linear.bias.requires_grad)
    return out


def _meta(meta: mc.ParamMeta, style: mc.Style, pname: str, mesh: Mesh, sp: bool) -> mc.ParamMeta:
    """The record of parameter ``pname`` of a module of ``style``."""
    tp = dict(tp_size=mesh.tp, tp_rank=mesh.tp_rank)
    if isinstance(style, mc.ColumnParallel) or (isinstance(style, mc.RowParallel) and pname == "weight"):
        dim = 1 if isinstance(style, mc.RowParallel) else 0
        return dataclasses.replace(meta, tp_dim=dim, layout=style.layout, **tp)
    if isinstance(style, (mc.VocabParallelEmbedding, mc.VocabParallelOutput)):
        return dataclasses.replace(meta, tp_dim=0, layout=mc.Contiguous(), embedding_or_output=pname == "weight", **tp)
    if isinstance(style, mc.HeadParallelTable):
        return dataclasses.replace(meta, tp_dim=style.dim, layout=style.layout, **tp)
    if isinstance(style, (mc.RowParallel, mc.SequenceParallelNorm)):  # a row-parallel bias is added to the shards
        return dataclasses.replace(meta, partial_over_tp=sp, **tp)
    if isinstance(style, mc.SharedByHeads):
        return dataclasses.replace(meta, partial_over_tp=mesh.tp > 1, **tp)
    if isinstance(style, mc.ExpertParallel):
        # Every rank's expert rows are its own (replicated rows are split first): a gradient is
        # whole for this rank's tokens and completed over the ranks holding the same slice (edp).
        expert = dict(grad_group="edp", ep_size=mesh.ep, ep_rank=mesh.ep_rank, tp_size=mesh.etp, tp_rank=mesh.etp_rank,
                      split_over="etp", matrix=len(meta.global_shape) == 3)  # fmt: skip
        dim, layout = expert_tensor_parallel_split(pname, style.fc1_layout)  # the layout names fc1's halves even when whole
        return dataclasses.replace(meta, tp_dim=dim if mesh.etp > 1 else None, layout=layout, **expert)
    return dataclasses.replace(meta, **tp)


# ---------------------------------------------------------------------- gradients after backward


def _sum_over(tensors: list[torch.Tensor], group) -> None:
    """All-reduce several tensors in place as one flat buffer (one collective, not one each)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


@torch.no_grad()
def finalize_tensor_parallel_grads(grads: dict[str, torch.Tensor], metas: ParamMetas, mesh: Mesh) -> None:
    """Complete the gradients tp leaves partial, in place (``grads``: name -> the gradient the
    optimizer reads). Those partial over tp are summed over it. Key/value rows replicated over tp
    (fewer kv heads than ranks): each rank scatters its copy's gradient into a zero table of all kv
    rows at its slot, one all-reduce adds the copies up, each rank reads its rows back."""
    if mesh.tp == 1:
        return
    _sum_over([g for n, g in grads.items() if metas[n].partial_over_tp], mesh.tp_group)
    replicated = [(g, metas[n].replicas()) for n, g in grads.items() if metas[n].replicas() is not None]
    tables = []
    for grad, rep in replicated:
        table = grad.new_zeros((rep.num_slots, *grad.shape[1:]))
        table[rep.slot.to(table.device)] = grad[rep.local.to(table.device)]
        tables.append(table)
    _sum_over(tables, mesh.tp_group)
    for (grad, rep), table in zip(replicated, tables):
        grad[rep.local.to(table.device)] = table[rep.slot.to(table.device)]


# ---------------------------------------------------------------------- whole tensors from shards


def gather_full(tensor: torch.Tensor, meta: mc.ParamMeta, mesh: Mesh) -> torch.Tensor:
    """The full tensor from every tp rank's shard of it (a weight, its gradient or an optimizer
    state of its shape) and, for routed experts, every etp rank's slice and ep rank's experts.
    Collective over tp (etp and ep for routed experts); the tensor itself when it is not split."""
    if tensor.dim() == 0:
        return tensor
    if meta.tp_dim is not None and meta.tp_size > 1:
        parts = [torch.empty_like(tensor) for _ in range(meta.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=mesh.group(meta.split_over))
        indices = [meta.layout.local_index(meta.global_shape[meta.tp_dim], meta.tp_size, r) for r in range(meta.tp_size)]
        shape = list(meta.global_shape)
        shape[0] = tensor.shape[0] if meta.ep_size > 1 else shape[0]  # this ep rank's experts only, so far
        full = tensor.new_empty(shape)
        # Replicated kv rows arrive from several ranks; their copies are equal.
        tensor = full.index_copy_(meta.tp_dim, torch.cat(indices).to(tensor.device), torch.cat(parts, dim=meta.tp_dim))
    if meta.ep_size > 1:
        parts = [torch.empty_like(tensor) for _ in range(meta.ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=mesh.ep_group)
        tensor = torch.cat(parts)  # ep rank r holds the r-th run of global expert ids
    return tensor
