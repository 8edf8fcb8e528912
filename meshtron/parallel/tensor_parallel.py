"""Tensor and sequence parallelism (Megatron-LM's): the collectives as autograd functions, and the
layers built on them.

A tensor-parallel pair of linears splits the first one's output features (column parallel) and
the second one's input features (row parallel), so the activation between them never needs
communicating; one all-reduce after the pair restores the full output. Its gradient mirror is an
all-reduce of the input's gradient before the pair. Each collective below therefore comes with
the one its backward needs: ``copy_to_tp_region`` (identity, then all-reduce of the gradient) is
the dual of ``reduce_from_tp_region`` (all-reduce, then identity).

Sequence parallelism splits the activations *outside* those pairs (norms, dropout, residuals)
along the sequence, since there every rank would otherwise repeat the same work on the same
tokens: the all-reduce after a pair becomes a reduce-scatter into sequence shards, and the pair's
input an all-gather of them. Same bytes on the wire, 1/tp of the activation memory.

Activations are ``[batch, seq, hidden]`` (the decoder's layout), so the sequence dimension is 1.
Every function takes the tensor-parallel group; with a group of one rank (or None, a one-process
run) each is the identity and each layer is exactly the plain op, with no collective at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshtron.kernels import grad_accum_fusion
from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum
from meshtron.kernels.fp8_scaling import Fp8Scaling
from meshtron.layers.output import labelled_rows, labelled_rows_and_weights, spread_to_tokens
from meshtron.parallel import tp_overlap
from meshtron.parallel.mesh import ShapeGroup

SEQ_DIM = 1


def group_size(group: dist.ProcessGroup | ShapeGroup | None) -> int:
    if isinstance(group, ShapeGroup):  # a ShapeMesh's: sizes only, no process
        return group.size
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | ShapeGroup | None) -> int:
    if isinstance(group, ShapeGroup):
        return group.rank
    return 0 if group is None else dist.get_rank(group)


# ---------------------------------------------------------------------- raw collectives


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)  # the input may still be needed by autograd
    dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim``, gathered into one buffer of rank-major parts:
    at batch 1 along the sequence that buffer already is the result (no copy); otherwise one
    reordering copy (the list form of ``all_gather`` copies every part out, then ``cat`` again)."""
    n, x = group_size(group), x.contiguous()
    parts = x.new_empty((n * x.shape[0], *x.shape[1:]))  # rank-major, concatenated along dim 0 (gloo takes only this form)
    dist.all_gather_into_tensor(parts, x, group=group)
    return parts.view(n, *x.shape).movedim(0, dim % x.dim()).flatten(dim % x.dim(), dim % x.dim() + 1)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split size {x.shape[dim]} of dim {dim} evenly over {n} tensor-parallel ranks")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over the group, keep this rank's 1/n slice of ``dim``.

    gloo lacks reduce-scatter in older torch releases; on the CPU (where gloo runs) speed is not
    the point, so it is an all-reduce followed by a slice there.
    """
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter size {x.shape[dim]} of dim {dim} over {n} tensor-parallel ranks")
    if dist.get_backend(group) == "gloo":
        return _split(_all_reduce(x, group), dim, group)
    if torch.compiler.is_compiling():
        # Compiled, the rank-major buffer below gave wrong gradients on 2 H200 (tp2 + sp, full
        # recompute; tests/gpu/feature_matrix.py); the list form is right there, and its copies are fused.
        out = torch.empty_like(x.chunk(n, dim=dim)[0], memory_format=torch.contiguous_format)
        dist.reduce_scatter(out, [c.contiguous() for c in x.chunk(n, dim=dim)], group=group)
        return out
    # rank-major chunks in one buffer: at batch 1 along the sequence, ``x`` itself (the list form
    # of ``reduce_scatter`` copies every chunk into a flat buffer first)
    dim = dim % x.dim()
    chunks = x.unflatten(dim, (n, -1)).movedim(dim, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    dist.reduce_scatter_tensor(out, chunks.flatten(0, 1), group=group)
    return out


# ---------------------------------------------------------------------- autograd functions


def _identity(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.view_as(x)


def _sum(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _all_reduce(x, group)


class _Paired(torch.autograd.Function):
    """A collective in forward and its adjoint in backward: Megatron's region functions, each
    defined below by its pair (identity/all-reduce, all-gather/split, reduce-scatter/all-gather...)."""

    @staticmethod
    def forward(ctx, x, forward_op, backward_op, group, dim):
        ctx.backward_op, ctx.group, ctx.dim = backward_op, group, dim
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None


def _paired(x: torch.Tensor, forward_op, backward_op, group, dim: int) -> torch.Tensor:
    return x if group_size(group) == 1 else _Paired.apply(x, forward_op, backward_op, group, dim)


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward identity, backward all-reduce: the input of a column-parallel layer."""
    return _paired(x, _identity, _sum, group, -1)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward all-reduce, backward identity: the output of a row-parallel layer."""
    return _paired(x, _sum, _identity, group, -1)


def sum_over_shares(x: torch.Tensor, group) -> torch.Tensor:
    """Forward all-reduce, backward all-reduce: a sum every rank of ``group`` reads whole while its
    backward carries only that rank's share of the gradient (context parallelism's ranks, each
    backwarding a share of the loss; tp ranks each normalizing their own heads by a full-width
    norm's sum of squares), so every share's gradient reaches every part."""
    return _paired(x, _sum, _sum, group, -1)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate the ranks' last-dim shards; backward keeps this rank's slice of the gradient."""
    return _paired(x, _all_gather, _split, group, -1)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's last-dim slice; backward gathers the gradient slices."""
    return _paired(x, _split, _all_gather, group, -1)


def all_gather_sequence(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """Sequence shards -> full sequence, before tensor-parallel compute; backward reduce-scatters,
    since each rank's gradient of the full sequence is only its partial sum."""
    return _paired(x, _all_gather, _reduce_scatter, group, dim)


def reduce_scatter_sequence(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """Partial sums of the full sequence -> this rank's summed shard; backward all-gathers."""
    return _paired(x, _reduce_scatter, _all_gather, group, dim)


def scatter_to_sequence_parallel(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """A replicated full sequence -> this rank's shard; backward all-gathers the shard gradients."""
    return _paired(x, _split, _all_gather, group, dim)


def gather_from_sequence_parallel(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """Shards -> the full tensor, which every rank then uses whole (as a replicated tensor);
    backward keeps this rank's slice of the (replicated) gradient. The adjoint of the above."""
    return _paired(x, _all_gather, _split, group, dim)


def enter_tp_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The input of tensor-parallel compute: replicated (copy, gradient all-reduced) or, under
    sequence parallelism, the sequence shards gathered (gradient reduce-scattered)."""
    return all_gather_sequence(x, group) if sequence_parallel else copy_to_tp_region(x, group)


# ---------------------------------------------------------------------- layers


def column_parallel_linear(x, weight, bias, group, sequence_parallel: bool, fp8: Fp8Scaling | None = None,
                           fuse_wgrad: bool = False, comm_overlap: str = "") -> torch.Tensor:  # fmt: skip
    """y_shard = x @ W_shard^T (+ b_shard), x replicated (or sequence-sharded with SP); in FP8 when
    ``fp8`` is given (``meshtron.kernels.fp8.apply_fp8`` gives the layers their scaling state), with the
    weight gradient fused into ``main_grad`` when ``fuse_wgrad`` (``grad_accum_fusion``). With SP
    and a ``comm_overlap`` backend (``--tp-comm-overlap``) the gather is pipelined with the GEMM
    (``tp_overlap``); FP8 layers keep the plain path.

    A function as well as a layer so the tied output head can run it on the embedding's weight.
    """
    if comm_overlap and sequence_parallel and fp8 is None and group_size(group) > 1:
        return tp_overlap.gather_linear(x, weight, bias, group, comm_overlap, fuse_wgrad)
    return grad_accum_fusion.linear(enter_tp_region(x, group, sequence_parallel), weight, bias, fp8, fuse_wgrad)


class TensorParallelEntry(nn.Module):
    """A column-parallel layer's input step alone, for a tensor read by this rank's heads without
    a linear in between (MLA's shared RoPE key): identity forward and all-reduce of the gradient,
    or, under sequence parallelism, all-gather of the sequence and reduce-scatter back."""

    def __init__(self, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return enter_tp_region(x, self.group, self.sequence_parallel)


class HeadShardSum(nn.Module):
    """Per-token sums over this rank's heads -> over all heads (the ``SumOverHeadShards`` style):
    summed over the tp group both ways (``sum_over_shares``), a head held by ``copies`` ranks
    (kv heads replicated when fewer than tp) counted once."""

    def __init__(self, group, copies: int):
        super().__init__()
        self.group, self.copies = group, copies

    def forward(self, partial_sums: torch.Tensor) -> torch.Tensor:
        total = sum_over_shares(partial_sums, self.group)
        return total / self.copies if self.copies > 1 else total


class ColumnParallelLinear(nn.Module):
    """A linear whose output features are split over the tensor-parallel ranks.

    ``out_features`` is this rank's share. ``gather_output`` concatenates the shards (for a
    consumer that needs all features); usually a row-parallel layer consumes the shard instead.
    ``comm_overlap`` (a ``tp_overlap`` backend, set by the plan) pipelines SP's gather with the GEMM.
    ``skip_bias_add``: the bias is left to the caller (``layers/mlp.enable_bias_gelu_fusion``).
    """

    skip_bias_add = False

    def __init__(self, in_features: int, out_features: int, bias: bool, group, sequence_parallel: bool = False,
                 gather_output: bool = False, device=None, dtype=None):  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, gather_output
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.fp8: Fp8Scaling | None = None
        self.grad_accum_fusion = False
        self.comm_overlap = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.skip_bias_add else self.bias
        y = column_parallel_linear(x, self.weight, bias, self.group, self.sequence_parallel, self.fp8,
                                   self.grad_accum_fusion, self.comm_overlap)  # fmt: skip
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out_shard={self.out_features}, bias={self.bias is not None}, "
                f"tp={group_size(self.group)}, sequence_parallel={self.sequence_parallel}")  # fmt: skip


class RowParallelLinear(nn.Module):
    """A linear whose input features are split over the tensor-parallel ranks.

    ``in_features`` is this rank's share. The partial products are summed (all-reduce, or
    reduce-scatter into sequence shards with SP) and only then is the bias added, once.
    ``comm_overlap`` (a ``tp_overlap`` backend, set by the plan) pipelines SP's reduce-scatter with the GEMM.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group, sequence_parallel: bool = False,
                 input_is_parallel: bool = True, device=None, dtype=None):  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel, self.input_is_parallel = group, sequence_parallel, input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.fp8: Fp8Scaling | None = None
        self.grad_accum_fusion = False
        self.comm_overlap = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:  # the plain op, bias fused into the GEMM as nn.Linear does
            return grad_accum_fusion.linear(x, self.weight, self.bias, self.fp8, self.grad_accum_fusion)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        if self.comm_overlap and self.sequence_parallel and self.fp8 is None:
            y = tp_overlap.linear_scatter(x, self.weight, self.group, self.comm_overlap, self.grad_accum_fusion)
            return y if self.bias is None else y + self.bias
        y = grad_accum_fusion.linear(x, self.weight, None, self.fp8, self.grad_accum_fusion)
        y = reduce_scatter_sequence(y, self.group) if self.sequence_parallel else reduce_from_tp_region(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_shard={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"tp={group_size(self.group)}, sequence_parallel={self.sequence_parallel}")  # fmt: skip


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (the vocabulary) are split in contiguous slices over the ranks.

    Each rank looks up the ids in its slice and writes zeros for the rest; summing over the ranks
    (all-reduce, or reduce-scatter into sequence shards with SP) gives every token its row.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group, sequence_parallel: bool = False,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        n = group_size(group)
        if num_embeddings % n:
            raise ValueError(f"vocabulary {num_embeddings} does not split evenly over {n} tensor-parallel ranks")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel = group, sequence_parallel
        rows = num_embeddings // n
        self.vocab_start = group_rank(group) * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.weight.shape[0])
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(out, self.group)
        return reduce_from_tp_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.vocab_start}.."
                f"{self.vocab_start + self.weight.shape[0] - 1}, sequence_parallel={self.sequence_parallel}")  # fmt: skip


class SequenceScatterEmbedding(nn.Embedding):
    """An embedding every tp rank holds whole (learned positions) whose output, under sequence
    parallelism, is cut to this rank's sequence shard to match the vocabulary embedding's
    reduce-scattered output; the cut's backward gathers, so the gradient is complete on every rank.
    Takes over the original module's weight (same parameter, same name)."""

    def __init__(self, embedding: nn.Embedding, group):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = embedding.weight
        self.group = group

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        out = super().forward(positions)
        return scatter_to_sequence_parallel(out, self.group, dim=out.dim() - 2)


class SequenceParallelFirstToken(nn.Module):
    """Each sequence's first row ``[b, h]`` of a sequence-sharded stream ``[b, s / tp, h]``: every
    rank's first row gathered, the first rank's kept (it holds token 0), so every rank reads the
    whole row; the gather's backward keeps each rank's own slot, so only the first rank's row
    receives the gradient (what reads the row runs whole on every rank, its gradient not partial)."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _paired(hidden[:, :1], _all_gather, _split, self.group, SEQ_DIM)[:, 0]


class VocabParallelOutputLayer(nn.Module):
    """The output layer with the vocabulary split over tp: this rank's rows of the projection
    (its own ``weight`` untied, else the vocabulary-parallel embedding's shard given at call
    time) and of its bias if it has one, logits kept sharded and the loss computed on the shards,
    so the [b, s, V] logits exist only when they are asked for (generation). ``vocab_size``: the
    real tokens; the rows past them (padding, on the last ranks' shards) take no part in the
    softmax or the loss, and generation's logits stop there."""

    def __init__(self, group, sequence_parallel: bool, fused_kernels: str = "auto", vocab_size: int = 0, weight_reused: bool = False):
        super().__init__()
        self.group, self.sequence_parallel, self.fused_kernels = group, sequence_parallel, fused_kernels
        self.vocab_size = vocab_size  # 0: every row is a token
        self.grad_accum_fusion = False  # set by apply_gradient_accumulation_fusion
        self.weight_reused = weight_reused  # as OutputLayer's: gradients of several calls meet in autograd
        self.fp8: Fp8Scaling | None = None  # as OutputLayer's: this rank scales its own shard
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                tied_weight: torch.Tensor | None = None, loss_weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """As ``OutputLayer.forward``. With ``loss_weights`` (fused kernels not off) the masked sum
        takes its gradients in the forward on this rank's vocabulary shard (with a bias, over the
        labelled rows only), the log-sum-exp and target logit summed over tp (``_combine_vocab_shards``)."""
        weight = self.weight if self.weight is not None else tied_weight
        start, shard = group_rank(self.group) * weight.shape[0], weight.shape[0]
        real = min(shard, max(0, self.vocab_size - start)) if self.vocab_size else shard  # this shard's token rows
        if labels is not None and loss_weights is not None and self.fused_kernels != "off":
            whole = enter_tp_region(hidden, self.group, self.sequence_parallel)
            if self.bias is not None:  # a masked LM: its labelled rows only
                whole, labels, loss_weights = labelled_rows_and_weights(whole, labels, loss_weights)
            combine = None if group_size(self.group) == 1 else lambda lse, target: _combine_vocab_shards(lse, target, self.group)
            return linear_cross_entropy_sum(whole, weight, labels, loss_weights, self.fused_kernels, vocab_start=start,
                                            combine_shards=combine, fuse_weight_grad=self.grad_accum_fusion and self.weight is not None and not self.weight_reused,
                                            real_rows=real, bias=self.bias, fp8=self.fp8)  # fmt: skip
        if labels is not None and self.bias is not None:  # the labelled rows only, as OutputLayer's
            rows, row_labels, index = labelled_rows(enter_tp_region(hidden, self.group, self.sequence_parallel), labels)
            logits = _without_padding(F.linear(rows, weight, self.bias), real)
            loss = spread_to_tokens(vocab_parallel_cross_entropy(logits.float(), row_labels, self.group), index, labels)
            return loss if loss_weights is None else (loss * loss_weights).sum()
        logits_shard = column_parallel_linear(hidden, weight, self.bias, self.group, self.sequence_parallel)
        if labels is None:
            logits = gather_from_tp_region(logits_shard, self.group)
            return logits[..., : self.vocab_size] if self.vocab_size else logits
        loss = vocab_parallel_cross_entropy(_without_padding(logits_shard, real).float(), labels, self.group)
        return loss if loss_weights is None else (loss * loss_weights).sum()


def _without_padding(logits_shard: torch.Tensor, real: int) -> torch.Tensor:
    """A shard's logits with its padded columns (from ``real`` on) at -inf: no probability mass,
    no gradient; the shard keeps its width, so every rank's slice stays where it was."""
    if real == logits_shard.shape[-1]:
        return logits_shard
    return logits_shard.masked_fill(torch.arange(logits_shard.shape[-1], device=logits_shard.device) >= real, float("-inf"))


# ---------------------------------------------------------------------- loss


def _combine_vocab_shards(lse: torch.Tensor, target: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole vocabulary's fp32 log-sum-exp and target logit from every rank's shard's."""
    top = _all_reduce(lse, group, dist.ReduceOp.MAX)
    return top + _all_reduce((lse - top).exp(), group).log(), _all_reduce(target, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """CE over logits split along the vocabulary, from three all-reduces of [b, s] tensors.

    The full [b, s, V] logits are never gathered: the max (for stability), the sum of
    exponentials and the target's logit are each reduced over the ranks. Backward is
    softmax - onehot restricted to this rank's slice, needing no communication.
    """

    @staticmethod
    def forward(ctx, logits, labels, group, ignore_index):
        dtype = logits.dtype
        logits = logits.float()
        shard = logits.shape[-1]
        start = group_rank(group) * shard
        logits_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        in_slice = (labels >= start) & (labels < start + shard)
        local_label = (labels - start).masked_fill(~in_slice, 0)
        target = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1).masked_fill(~in_slice, 0.0)
        target = _all_reduce(target, group)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        ignored = labels == ignore_index
        loss = (sum_exp.log() - target).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_label, in_slice, ignored)
        ctx.dtype = dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_label, in_slice, ignored = ctx.saved_tensors
        minus_onehot = -in_slice.unsqueeze(-1).to(softmax.dtype)
        grad = softmax.scatter_add(-1, local_label.unsqueeze(-1), minus_onehot)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, labels: torch.Tensor, group, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shaped like ``labels``; ``ignore_index`` gives 0) from this
    rank's contiguous vocabulary slice of the logits, ``[..., V / tp]``."""
    if group_size(group) == 1:
        flat = logits_shard.float().reshape(-1, logits_shard.shape[-1])
        return F.cross_entropy(flat, labels.reshape(-1), reduction="none", ignore_index=ignore_index).view(labels.shape)
    return _VocabParallelCrossEntropy.apply(logits_shard, labels, group, ignore_index)
