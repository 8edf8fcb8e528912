"""Tensor (+ sequence) parallelism applied to a plain ``Decoder``, from outside the model.

Every rank builds the same full model from the same seed (its initialization is
layout-invariant), then ``apply_tensor_parallel`` swaps each linear layer and the embedding for
the parallel layer holding this rank's shard. The model files keep no trace of ranks.

Each sharded parameter carries ``param.tp_shard`` (which rows or columns of the full tensor it
holds), which is all ``full_state_dict`` / ``shard_state_dict`` need to move a checkpoint between
layouts, and what a test needs to compare a gradient with the one-process run. Parameters every
tensor-parallel rank holds whole but, under sequence parallelism, sees only part of the tokens
(norms, row-parallel biases) carry ``param.sequence_parallel = True``: their gradients are
partial sums until ``allreduce_sequence_parallel_grads`` adds them up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config import ConfigError, ModelConfig
from meshtron.layers.attention import Attention, head_dim, num_kv_heads
from meshtron.layers.mlp import MLP, ffn_hidden_size
from meshtron.models.decoder import Decoder
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    gather_from_tp_region,
    scatter_to_sequence_parallel,
    vocab_parallel_cross_entropy,
)


@dataclass
class TPShard:
    """This rank's part of a full tensor: positions ``index`` (into ``full_size``) along ``dim``."""

    dim: int
    index: torch.Tensor
    full_size: int


@dataclass
class TPReplicas:
    """Rows that several tensor-parallel ranks hold copies of (key/value heads when there are fewer
    than tp of them): local rows ``local`` are rows ``slot`` of a ``num_slots``-row table shared by
    the group; each copy sees only its ranks' query heads, so the true gradient is their sum."""

    local: torch.Tensor
    slot: torch.Tensor
    num_slots: int
    counted: bool  # the copy a gradient norm counts (the first rank holding it)


def check_model_fits(model_cfg: ModelConfig, mesh: Mesh, seq_length: int = 0, sequence_parallel: bool = False,
                     vocab_size: int = 0) -> None:  # fmt: skip
    """Raise ConfigError (naming the fix) when the model's shapes cannot be split over ``mesh.tp``.

    Fewer key/value heads than tensor-parallel ranks is allowed when tp is a multiple of them:
    each kv head is then replicated on the tp / kv ranks whose query heads read it.
    """
    tp = mesh.tp_size
    heads, kv = model_cfg.num_attention_heads, num_kv_heads(model_cfg)
    ok_tp = [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    errors = []
    if heads % tp:
        errors.append(f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}; "
                      f"use a tensor-parallel size in {ok_tp} or change the number of heads")  # fmt: skip
    if kv % tp and tp % kv:
        errors.append(f"--num-query-groups {kv} (key/value heads) and --tensor-model-parallel-size {tp} must divide "
                      f"one another (kv heads split over the ranks, or each replicated on tp/kv ranks); use a "
                      f"tensor-parallel size in {ok_tp} or change the number of query groups")  # fmt: skip
    ffn = ffn_hidden_size(model_cfg)
    if ffn % tp:
        errors.append(f"the MLP width {ffn} (--ffn-hidden-size) is not divisible by --tensor-model-parallel-size {tp}; "
                      f"set --ffn-hidden-size to a multiple of {tp}")  # fmt: skip
    if vocab_size % tp:
        errors.append(f"the vocabulary {vocab_size} is not divisible by --tensor-model-parallel-size {tp}; pad it "
                      f"(--make-vocab-size-divisible-by) to a multiple of {tp}")  # fmt: skip
    if sequence_parallel and tp > 1 and seq_length % tp:
        errors.append(f"--sequence-parallel splits --seq-length {seq_length} over {tp} ranks; use a sequence length "
                      f"that is a multiple of {tp} or drop --sequence-parallel")  # fmt: skip
    if errors:
        raise ConfigError("model does not fit the tensor-parallel layout:\n  - " + "\n  - ".join(errors))


# ---------------------------------------------------------------------- which rows each rank holds


def _span(start: int, length: int) -> torch.Tensor:
    return torch.arange(start, start + length)


def _qkv_rows(cfg: ModelConfig, tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of the fused QKV weight this rank holds, and which of them are shared kv rows.

    The full layout is [kv groups, (group's query heads, k, v), head_dim]. With kv >= tp a rank
    takes whole groups; with kv < tp the ranks of one group split its query heads and each keeps
    the group's k and v, so the local layout is again [1 group, (heads/tp queries, k, v), head_dim]
    and the attention module runs unchanged on it.
    """
    heads, kv, hd = cfg.num_attention_heads, num_kv_heads(cfg), head_dim(cfg)
    per_group = heads // kv + 2
    if kv >= tp:
        rows = _span(rank * (kv // tp) * per_group * hd, (kv // tp) * per_group * hd)
        return rows, None
    group, q_first = rank // (tp // kv), (rank % (tp // kv)) * (heads // tp)
    base = group * per_group * hd
    q = _span(base + q_first * hd, (heads // tp) * hd)
    k_and_v = _span(base + (per_group - 2) * hd, 2 * hd)
    return torch.cat([q, k_and_v]), _span(group * 2 * hd, 2 * hd)


def _contiguous(size: int, tp: int, rank: int) -> torch.Tensor:
    return _span(rank * (size // tp), size // tp)


def _fc1_rows(ffn: int, swiglu: bool, tp: int, rank: int) -> torch.Tensor:
    """Rows of fc1: with SwiGLU, this rank's slice of gate and the matching slice of up, so the
    local output is again [gate | up] and the MLP's ``chunk(2)`` still pairs them."""
    rows = _contiguous(ffn, tp, rank)
    return torch.cat([rows, rows + ffn]) if swiglu else rows


# ---------------------------------------------------------------------- module swaps


def _mark_shard(param: nn.Parameter, dim: int, index: torch.Tensor, full_size: int) -> None:
    param.tp_shard = TPShard(dim, index, full_size)


@torch.no_grad()
def _column(linear: nn.Linear, rows: torch.Tensor, mesh: Mesh, sequence_parallel: bool) -> ColumnParallelLinear:
    w = linear.weight
    out = ColumnParallelLinear(w.shape[1], len(rows), linear.bias is not None, mesh.tp_group, sequence_parallel,
                               device=w.device, dtype=w.dtype)  # fmt: skip
    for name in ("weight", "bias"):
        full = getattr(linear, name)
        if full is not None:
            param = getattr(out, name)
            param.copy_(full.index_select(0, rows.to(full.device)))
            param.requires_grad_(full.requires_grad)
            _mark_shard(param, 0, rows, full.shape[0])
    return out


@torch.no_grad()
def _row(linear: nn.Linear, cols: torch.Tensor, mesh: Mesh, sequence_parallel: bool) -> RowParallelLinear:
    w = linear.weight
    out = RowParallelLinear(len(cols), w.shape[0], linear.bias is not None, mesh.tp_group, sequence_parallel,
                            device=w.device, dtype=w.dtype)  # fmt: skip
    out.weight.copy_(w.index_select(1, cols.to(w.device)))
    out.weight.requires_grad_(w.requires_grad)
    _mark_shard(out.weight, 1, cols, w.shape[1])
    if linear.bias is not None:
        out.bias.copy_(linear.bias)
        out.bias.requires_grad_(linear.bias.requires_grad)
        # Added after the reduce-scatter, to this rank's tokens only.
        out.bias.sequence_parallel = sequence_parallel
    return out


@torch.no_grad()
def _vocab_embedding(embedding: nn.Embedding, mesh: Mesh, sequence_parallel: bool) -> VocabParallelEmbedding:
    w = embedding.weight
    out = VocabParallelEmbedding(w.shape[0], w.shape[1], mesh.tp_group, sequence_parallel, device=w.device, dtype=w.dtype)
    rows = _contiguous(w.shape[0], mesh.tp_size, mesh.tp_rank)
    out.weight.copy_(w.index_select(0, rows.to(w.device)))
    out.weight.requires_grad_(w.requires_grad)
    _mark_shard(out.weight, 0, rows, w.shape[0])
    return out


class TensorParallelDecoder(Decoder):
    """The class ``apply_tensor_parallel`` gives a sharded decoder (as FSDP2 swaps classes): the
    output projection keeps the vocabulary sharded and the loss is computed on the shards, so the
    [b, s, V] logits exist only when ``logits`` is asked for them (generation)."""

    def _logits_shard(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(hidden)
        emb = self.embedding  # tied: the embedding's vocabulary slice is the output's
        return column_parallel_linear(hidden, emb.weight, None, emb.group, emb.sequence_parallel)

    @property
    def _vocab_group(self):
        """The tp group the vocabulary is split over (the output layer's; a pipeline's last stage
        may hold no input embedding)."""
        return (self.output if self.output is not None else self.embedding).group

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_from_tp_region(self._logits_shard(hidden), self._vocab_group)

    def output_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self._logits_shard(hidden).float(), labels, self._vocab_group)


def apply_tensor_parallel(model: Decoder, mesh: Mesh, sequence_parallel: bool) -> Decoder:
    """Shard ``model`` (a full ``Decoder``, identical on every rank) over ``mesh.tp``, in place.

    Attention: q heads and kv groups split so each rank has whole heads (kv heads replicated when
    fewer than tp), output projection split by the same heads. MLP: fc1 by output features (gate
    and up separately for SwiGLU), fc2 by input features. Embedding and output layer: by
    vocabulary, the loss computed on the shards. With ``sequence_parallel`` the residual stream
    between the tensor-parallel regions holds 1/tp of the tokens on each rank: norms and dropout
    run on the shards. At tp 1 the model is returned as it is.
    """
    if mesh.tp_size == 1:
        return model
    if type(model) is not Decoder:
        raise TypeError(f"apply_tensor_parallel shards a plain Decoder, got {type(model).__name__} (applied twice?)")
    cfg, tp, rank, sp = model.cfg, mesh.tp_size, mesh.tp_rank, sequence_parallel
    check_model_fits(cfg, mesh, vocab_size=model.vocab_size)
    heads, kv, hd = cfg.num_attention_heads, num_kv_heads(cfg), head_dim(cfg)

    model.embedding = _vocab_embedding(model.embedding, mesh, sp)
    if sp and model.position_embedding is not None:
        # Positions are looked up whole, then cut to this rank's tokens to match the embedding's
        # reduce-scattered output; the cut's backward gathers, so its gradient is complete.
        model.position_embedding.register_forward_hook(
            lambda module, args, out: scatter_to_sequence_parallel(out, mesh.tp_group, dim=out.dim() - 2)
        )
    if model.output is not None:
        model.output = _column(model.output, _contiguous(model.vocab_size, tp, rank), mesh, sp)

    qkv_rows, kv_slots = _qkv_rows(cfg, tp, rank)
    head_cols = _contiguous(heads * hd, tp, rank)
    for layer in model.layers:
        attn, mlp = layer.self_attention, layer.mlp
        if not isinstance(attn, Attention) or not isinstance(mlp, MLP):
            raise NotImplementedError(f"tensor parallelism of {type(attn).__name__}/{type(mlp).__name__} is not implemented")
        attn.linear_qkv = _column(attn.linear_qkv, qkv_rows, mesh, sp)
        if kv_slots is not None:
            local_kv = _span(len(qkv_rows) - 2 * hd, 2 * hd)
            for param in attn.linear_qkv.parameters():
                param.tp_replicas = TPReplicas(local_kv, kv_slots, 2 * kv * hd, rank % (tp // kv) == 0)
        attn.linear_proj = _row(attn.linear_proj, head_cols, mesh, sp)
        attn.num_heads, attn.num_kv_heads = heads // tp, max(1, kv // tp)
        ffn = ffn_hidden_size(cfg)
        mlp.linear_fc1 = _column(mlp.linear_fc1, _fc1_rows(ffn, mlp.swiglu, tp, rank), mesh, sp)
        mlp.linear_fc2 = _row(mlp.linear_fc2, _contiguous(ffn, tp, rank), mesh, sp)
        for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
            for param in norm.parameters():
                param.sequence_parallel = sp
    for param in model.final_norm.parameters():
        param.sequence_parallel = sp
    model.__class__ = TensorParallelDecoder
    return model


# ---------------------------------------------------------------------- gradients


def _grad(param: nn.Parameter) -> torch.Tensor | None:
    """Where the optimizer keeps this parameter's gradient: its fp32 ``main_grad`` when a gradient
    buffer owns it (bf16/fp16 params have ``.grad`` freed after accumulation), else ``.grad``."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def _sum_over(tensors: list[torch.Tensor], group) -> None:
    """All-reduce several tensors in place as one flat buffer (one collective, not one each)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


@torch.no_grad()
def allreduce_sequence_parallel_grads(model: nn.Module, mesh: Mesh) -> None:
    """Sum over tp the gradients of parameters marked ``sequence_parallel`` (each rank saw 1/tp of
    the tokens). Call after backward, before data-parallel reduction and clipping."""
    if mesh.tp_size == 1:
        return
    grads = [_grad(p) for p in model.parameters() if getattr(p, "sequence_parallel", False) and _grad(p) is not None]
    _sum_over(grads, mesh.tp_group)


@torch.no_grad()
def allreduce_replicated_kv_grads(model: nn.Module, mesh: Mesh) -> None:
    """Sum the gradients of key/value rows replicated over tp (fewer kv heads than tp ranks).

    Each rank scatters its copy's gradient into a zero table of all kv rows at its slot, one
    all-reduce over tp adds the copies up, and each rank reads its rows back.
    """
    if mesh.tp_size == 1:
        return
    params = [p for p in model.parameters() if getattr(p, "tp_replicas", None) is not None and _grad(p) is not None]
    tables = []
    for p in params:
        rep, grad = p.tp_replicas, _grad(p)
        table = grad.new_zeros((rep.num_slots, *grad.shape[1:]))
        table[rep.slot.to(table.device)] = grad[rep.local.to(table.device)]
        tables.append(table)
    _sum_over(tables, mesh.tp_group)
    for p, table in zip(params, tables):
        rep = p.tp_replicas
        _grad(p)[rep.local.to(table.device)] = table[rep.slot.to(table.device)]


def finalize_tensor_parallel_grads(model: nn.Module, mesh: Mesh) -> None:
    """Every tensor-parallel gradient fix-up a step needs, in one call for the training loop."""
    allreduce_sequence_parallel_grads(model, mesh)
    allreduce_replicated_kv_grads(model, mesh)


def grad_norm_squared(params: list[nn.Parameter], grads: list[torch.Tensor], mesh: Mesh) -> torch.Tensor:
    """Squared L2 norm of the full model's gradient over the tp group (fp32, 0-d, on every tp rank).

    ``grads[i]`` is the gradient of ``params[i]`` (the optimizer's fp32 copy may stand in for
    ``.grad``). Shards count once each; a tensor every tp rank holds whole counts on tp rank 0
    only, and replicated kv rows on their first copy, so nothing is counted twice. Call after
    ``finalize_tensor_parallel_grads``; reduce the result over pp (and dp for sharded optimizers).
    """
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for param, grad in zip(params, grads):
        g = grad.float()
        if getattr(param, "tp_shard", None) is None:
            total += g.square().sum() if mesh.tp_rank == 0 else 0.0
            continue
        rep = getattr(param, "tp_replicas", None)
        total += g.square().sum()
        if rep is not None and not rep.counted:
            total -= g[rep.local.to(g.device)].square().sum()
    if mesh.tp_size > 1:
        dist.all_reduce(total, group=mesh.tp_group)
    return total


# ---------------------------------------------------------------------- layout-free state dicts


def gather_full(tensor: torch.Tensor, shard: TPShard, mesh: Mesh) -> torch.Tensor:
    """The full tensor from every tp rank's ``shard`` of it (a weight, or its gradient)."""
    group = mesh.tp_group
    parts = [torch.empty_like(tensor) for _ in range(mesh.tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    index = shard.index.to(tensor.device)  # NCCL moves only GPU tensors
    indices = [torch.empty_like(index) for _ in range(mesh.tp_size)]
    dist.all_gather(indices, index, group=group)
    shape = list(tensor.shape)
    shape[shard.dim] = shard.full_size
    full = tensor.new_empty(shape)
    # Replicated kv rows arrive from several ranks; their copies are equal.
    full.index_copy_(shard.dim, torch.cat(indices), torch.cat(parts, dim=shard.dim))
    return full


@torch.no_grad()
def full_state_dict(model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    """The one-process model's state dict (same names, full tensors) from a tensor-parallel one.
    Collective over tp: every rank of the group must call it."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        shard = getattr(t, "tp_shard", None)
        out[name] = t.detach() if shard is None or mesh.tp_size == 1 else gather_full(t.detach(), shard, mesh)
    return out


@torch.no_grad()
def shard_state_dict(full_sd: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's slices of a full state dict, ready for ``model.load_state_dict`` (any tp size)."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        shard = getattr(t, "tp_shard", None)
        full = full_sd[name]
        out[name] = full if shard is None else full.index_select(shard.dim, shard.index.to(full.device))
    return out
