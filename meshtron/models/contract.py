"""The model contract: what a model family hands the rest of meshtron, as data and small methods.

A family (``models/decoder.py``, the test families, later MoE/BERT/T5) is a plain ``nn.Module``
that also says:

- its **parallel plan** (``parallel_plan()``): module-name patterns mapped to the styles below
  (column, row, vocabulary, sequence-parallel norm, sequence scatter, first token, context-parallel
  core attention, expert parallel, sequence sum, gather over data parallel).
  ``meshtron.parallel.plan`` applies any plan by one mechanism, module replacement, and returns
  one ``ParamMeta`` per parameter;
- its **pipeline pieces** (``pipeline_pieces()`` plus ``embed``/``block_inputs``/``run_blocks``/
  ``head``): ``embed -> ordered blocks -> head``, with the tensors that travel between stages a
  dict the model names and shapes (``carry_shapes``), so any contiguous run of blocks can be a
  stage and the runner never builds a model's batch or hidden state itself;
- its **loss** (``loss(batch, outputs) -> LossOutput`` and ``loss_count(batch)``, the normalizer
  known before the forward, as pipelined backward needs it), with named auxiliary terms that
  ``run_blocks`` returns on whatever stage they arise;
- its **batch**: the dataset's dict of tensors, consumed by the model, only moved by the trainer.

Everything here is layout-free: sizes of a parallel dimension enter only through ``ParamMeta``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtron.models.recompute import recompute_contexts

Batch = dict[str, torch.Tensor]
Carry = dict[str, torch.Tensor]


@dataclass
class LossOutput:
    """One micro batch's (or a step's) loss: ``total`` summed over what ``count`` counts (tokens,
    queries), ``aux`` terms already weighted (each enters the objective as it is), ``metrics`` to
    log only (per-micro-batch means, averaged over the global batch as the ``aux`` terms are). The objective the runner backwards is ``total / global count + sum(aux) / micro batches``,
    with ``aux`` both the blocks' terms (``run_blocks``) and these: a second loss normalized per
    sample (BERT's sentence order) is its micro batch's mean here, and so the global batch's mean
    (micro batches are equally large) without a second count."""

    total: torch.Tensor
    count: torch.Tensor
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class HeadWithAux:
    """A head's outputs with auxiliary loss terms of its own (multi-token prediction's per-depth
    losses): ``TokenLossModel.loss`` adds ``aux`` to the ``LossOutput`` of ``outputs``."""

    outputs: Any
    aux: dict[str, torch.Tensor]


@dataclass
class SummedTokenLoss:
    """A language-model head's loss already summed over the batch's ``loss_mask`` (fp32 scalar):
    what the head returns when its output layer takes the gradients in the forward
    (``--cross-entropy-loss-fusion``), which needs the mask there. Other heads return per-token losses."""

    total: torch.Tensor


# ---------------------------------------------------------------------- how a sharded dim maps to ranks


def _span(start: int, length: int) -> torch.Tensor:
    return torch.arange(start, start + length)


@dataclass(frozen=True)
class Contiguous:
    """The dim is cut into ``tp`` equal consecutive runs; rank r takes run r."""

    def local_index(self, size: int, tp: int, rank: int) -> torch.Tensor:
        return _span(rank * (size // tp), size // tp)

    def divisible(self, size: int, tp: int) -> bool:
        return size % tp == 0

    def replicas(self, tp: int, rank: int) -> None:
        return None


@dataclass(frozen=True)
class Halves:
    """The dim is ``parts`` logical halves side by side (SwiGLU's [gate | up]); each is cut like
    ``Contiguous`` and a rank keeps its run of every part, so its local tensor is again
    [gate_shard | up_shard] and the module's ``chunk(parts)`` still pairs them."""

    parts: int = 2

    def local_index(self, size: int, tp: int, rank: int) -> torch.Tensor:
        part = size // self.parts
        run = _span(rank * (part // tp), part // tp)
        return torch.cat([run + i * part for i in range(self.parts)])

    def divisible(self, size: int, tp: int) -> bool:
        return size % (self.parts * tp) == 0

    def replicas(self, tp: int, rank: int) -> None:
        return None


@dataclass(frozen=True)
class Replicas:
    """Rows several tp ranks hold copies of (kv heads when there are fewer than tp): local rows
    ``local`` are rows ``slot`` of a ``num_slots``-row table shared by the group; each copy sees
    only its own query heads, so the true gradient is the sum of the copies."""

    local: torch.Tensor
    slot: torch.Tensor
    num_slots: int
    counted: bool  # the copy a gradient norm counts (the first rank holding it)


@dataclass(frozen=True)
class GroupedHeads:
    """A fused QKV dim laid out [kv_groups, queries_per_group + 2 (k, v), head_dim].

    kv_groups >= tp: a rank takes whole groups. kv_groups < tp (tp a multiple of it): the ranks of
    one group split its query heads and each keeps the group's k and v (``replicas``), so the local
    layout is again [1 group, queries / tp, k, v] and attention runs unchanged on it.
    """

    kv_groups: int
    queries_per_group: int
    head_dim: int

    def divisible(self, size: int, tp: int) -> bool:
        heads, kv = self.kv_groups * self.queries_per_group, self.kv_groups
        return heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)

    def local_index(self, size: int, tp: int, rank: int) -> torch.Tensor:
        kv, hd, per_group = self.kv_groups, self.head_dim, self.queries_per_group + 2
        if kv >= tp:
            return _span(rank * (kv // tp) * per_group * hd, (kv // tp) * per_group * hd)
        queries = kv * self.queries_per_group // tp
        group, q_first = rank // (tp // kv), (rank % (tp // kv)) * queries
        base = group * per_group * hd
        return torch.cat([_span(base + q_first * hd, queries * hd), _span(base + (per_group - 2) * hd, 2 * hd)])

    def replicas(self, tp: int, rank: int) -> Replicas | None:
        kv, hd = self.kv_groups, self.head_dim
        if kv >= tp:
            return None
        local_rows = (kv * self.queries_per_group // tp + 2) * hd
        group = rank // (tp // kv)
        return Replicas(_span(local_rows - 2 * hd, 2 * hd), _span(group * 2 * hd, 2 * hd), 2 * kv * hd, rank % (tp // kv) == 0)


@dataclass(frozen=True)
class Heads:
    """A dim of ``heads`` runs of ``head_dim`` (a full-width q or k norm's weight), cut as
    ``GroupedHeads`` cuts the heads it belongs to: heads >= tp, whole heads in contiguous runs;
    fewer heads than ranks (kv heads; tp a multiple of them), rank r keeps head r // (tp / heads),
    a replica on tp / heads ranks."""

    heads: int
    head_dim: int

    def divisible(self, size: int, tp: int) -> bool:
        return self.heads % tp == 0 or tp % self.heads == 0

    def local_index(self, size: int, tp: int, rank: int) -> torch.Tensor:
        if self.heads >= tp:
            return _span(rank * (size // tp), size // tp)
        return _span(rank // (tp // self.heads) * self.head_dim, self.head_dim)

    def replicas(self, tp: int, rank: int) -> Replicas | None:
        if self.heads >= tp:
            return None
        copies = tp // self.heads
        return Replicas(_span(0, self.head_dim), self.local_index(0, tp, rank), self.heads * self.head_dim, rank % copies == 0)


Layout = Contiguous | Halves | GroupedHeads | Heads


# ---------------------------------------------------------------------- parallel plan styles


@dataclass(frozen=True)
class ColumnParallel:
    """An ``nn.Linear`` whose output features (and bias) are split over tp by ``layout``."""

    layout: Layout = Contiguous()


@dataclass(frozen=True)
class RowParallel:
    """An ``nn.Linear`` whose input features are split over tp by ``layout``; partial products
    summed (reduce-scattered under sequence parallelism), then the whole bias added once."""

    layout: Layout = Contiguous()


@dataclass(frozen=True)
class VocabParallelEmbedding:
    """An ``nn.Embedding`` whose rows (the vocabulary) are split contiguously over tp."""


@dataclass(frozen=True)
class VocabParallelOutput:
    """An ``OutputLayer`` (``layers/output.py``): logits and loss computed on vocabulary shards."""


@dataclass(frozen=True)
class HeadParallelTable:
    """A module whose ``weight`` has one entry (``Contiguous``), or one run (``Heads``), per attention
    head along ``dim`` and whose heads are read only by those heads' attention (T5's relative
    position table [buckets, heads]; a full-width q/k norm's weight): each tp rank keeps its heads'
    slice, split by ``layout`` as the attention splits its heads, and the module runs unchanged on
    it (no communication of its own)."""

    dim: int
    layout: Layout = Contiguous()


@dataclass(frozen=True)
class SequenceParallelNorm:
    """A module every tp rank holds whole which, under sequence parallelism, sees 1/tp of the
    tokens (norms; MLA's down-projections and latent norms): its gradients are partial sums,
    added up over tp after backward."""


@dataclass(frozen=True)
class SharedByHeads:
    """A module every tp rank holds whole and applies to each of its own attention heads (the
    per-head q and k norms of ``--qk-layernorm``): each rank's gradient covers its heads only, a
    partial sum added up over tp after backward, with or without sequence parallelism."""


@dataclass(frozen=True)
class SumOverHeadShards:
    """A module summing per-token values over the attention heads it sees (identity in one
    process; a full-width q/k norm's sum of squares): under tensor parallelism replaced by the sum
    over the tp ranks' heads, its gradient summed over them too (every rank reads the total).
    ``heads``: the heads the width spans; with fewer than tp ranks, each head's tp / heads replicas
    are counted once."""

    heads: int


@dataclass(frozen=True)
class ScatterToSequence:
    """A module whose output covers the whole sequence on every tp rank (learned positions):
    under sequence parallelism it is cut to this rank's sequence shard."""


@dataclass(frozen=True)
class FirstTokenOfSequence:
    """A module reading each sequence's first row of the residual stream, ``[b, s, h] -> [b, h]``
    (BERT's [CLS] for its pooler): under sequence parallelism, where the first tp rank alone holds
    that row, replaced by a gather of every rank's first row that keeps the first rank's, so what
    reads it runs whole on every tp rank; its backward hands the gradient to that rank's row only."""


@dataclass(frozen=True)
class ContextParallelCore:
    """A core-attention module (q, k, v, mask, dropout, document_ids -> out on [b, heads, s, d])
    replaced by attention across the cp ranks' sequence chunks, with the core's ``scale``
    attribute (the softmax scale) where it has one."""


@dataclass(frozen=True)
class EnterTensorParallel:
    """An identity module where a tensor every tp rank computes whole (or, under sequence
    parallelism, for its own tokens) is read by this rank's heads only (MLA's shared RoPE key):
    replaced by what a column-parallel layer does to its input, so its gradient is summed over tp
    (all-gather of the sequence forward, reduce-scatter backward, under sequence parallelism)."""


@dataclass(frozen=True)
class ExpertParallel:
    """Routed experts (``layers/moe/experts.py``'s interface: rows grouped by global expert, the
    per-expert group sizes -> outputs in the same rows) whose stacked weights' dim 0 is the global
    expert id: each expert-parallel rank keeps ``num_experts / ep`` consecutive experts and the
    rows are exchanged over the ep group by ``dispatcher`` (``alltoall`` or ``allgather``). Their
    gradients are reduced over the expert-data-parallel group.

    With expert tensor parallelism each expert's FFN is split over tp like the dense MLP:
    ``weight1`` [E, fc1, h] by its fc1 rows in ``fc1_layout`` (``Halves(2)`` for SwiGLU's [gate;
    up]), ``weight2`` [E, h, ffn] by its ffn columns. Without it the experts are whole on every tp
    rank, and under sequence parallelism their gradients are partial sums over tp (each tp rank
    routes its own sequence shard). ``overlap_chunks`` > 1: the alltoall exchange runs in that many
    chunks of local experts, each chunk's all-to-all in flight while another chunk's experts compute."""

    dispatcher: str = "alltoall"
    fc1_layout: Layout = Contiguous()
    overlap_chunks: int = 0


@dataclass(frozen=True)
class SequenceSum:
    """A module summing per-token statistics over the tokens it sees (identity when it sees the
    whole micro batch): under sequence and context parallelism replaced by a sum over the tp and
    cp ranks holding the other tokens of the same sequences, so a statistic over whole sequences
    (a balancing loss's token fractions, per sequence too) equals one process's, gradient included.
    ``over_tp`` False: the values are whole on every tp rank already (sums of a loss the output
    layer computed after gathering the sequence), so only the cp ranks' parts are summed."""

    over_tp: bool = True


@dataclass(frozen=True)
class GatherOverDataParallel:
    """A module mapping this rank's per-sample rows ``[b, ...]`` to the rows of the same micro
    batch on every data-parallel rank, in rank order, with the index of this rank's first row:
    ``rows -> (all_rows [dp * b, ...], first)``; in one process ``(rows, 0)``. A loss over the
    whole data-parallel micro batch (the retriever's in-batch negatives) reads it. Its backward
    hands each rank the sum of every rank's gradient for its rows, so the parameter gradients
    summed over dp equal one process's on the concatenated batch."""


Style = (ColumnParallel | RowParallel | VocabParallelEmbedding | VocabParallelOutput | HeadParallelTable | SequenceParallelNorm
         | SharedByHeads | SumOverHeadShards | ScatterToSequence | FirstTokenOfSequence | ContextParallelCore | EnterTensorParallel | ExpertParallel | SequenceSum
         | GatherOverDataParallel)  # fmt: skip
Plan = list[tuple[str, Style]]  # (fnmatch pattern over module names, style); first match wins


# ---------------------------------------------------------------------- one record per parameter


@dataclass
class ParamMeta:
    """Everything layout-aware code needs to know about one parameter, and nothing else does.

    The optimizer (grad norm, weight decay), the gradient buffers, FSDP, the distributed
    optimizer and the checkpoint read this record; no parameter carries layout attributes.
    ``tp_dim`` is the dim split over tp (None: whole on every tp rank), ``layout`` how its rows map
    to ranks. ``partial_over_tp``: its gradient is a partial sum over tp (sequence parallelism, or
    a module applied to each rank's heads).
    ``pipeline_copy``: "" for most; "first"/"other" for a weight two pipeline stages hold (a tied
    embedding), whose gradients are summed between them and counted once, on "first".
    ``grad_group``: the mesh dimension its gradient is reduced over ("edp" for routed experts).
    ``ep_size`` / ``ep_rank``: a routed expert weight's dim 0 (the global expert id) is cut into
    ``ep_size`` consecutive runs; this rank holds run ``ep_rank`` (1 / 0: whole). Under expert
    tensor parallelism it is also split along ``tp_dim`` (each local expert's fc1 rows or fc2
    columns): a rank's part is the product of the two.
    ``split_over``: the mesh dimension ``tp_size`` / ``tp_rank`` count (``tp_dim`` is split over it,
    whole copies repeat over it): "tp", or "etp" for routed experts, whose grid is the expert one.
    ``matrix``: a linear layer's weight (routed experts: a stack of them), what Muon orthogonalizes
    (``layout`` then also says how its rows split into blocks, SwiGLU's halves or QKV's heads);
    embeddings, the output layer, routers, norms and biases are not.
    ``embedding_or_output``: the word embeddings' or the output layer's weight, which
    ``--decoupled-lr`` trains at its own rate (Megatron's ``is_embedding_or_output_parameter``).
    """

    global_shape: tuple[int, ...]
    tp_dim: int | None = None
    layout: Layout = Contiguous()
    tp_size: int = 1
    tp_rank: int = 0
    partial_over_tp: bool = False
    pipeline_copy: str = ""
    grad_group: str = "dp_cp"
    weight_decay: bool = True
    ep_size: int = 1
    ep_rank: int = 0
    split_over: str = "tp"
    matrix: bool = False
    embedding_or_output: bool = False

    def expert_index(self) -> torch.Tensor | None:
        """Global expert ids (positions along dim 0) this rank holds (None when whole)."""
        if self.ep_size == 1:
            return None
        local = self.global_shape[0] // self.ep_size
        return _span(self.ep_rank * local, local)

    def local_index(self) -> torch.Tensor | None:
        """Positions along ``tp_dim`` of the global tensor this rank holds (None when whole)."""
        if self.tp_dim is None:
            return None
        return self.layout.local_index(self.global_shape[self.tp_dim], self.tp_size, self.tp_rank)

    def replicas(self) -> Replicas | None:
        return None if self.tp_dim is None else self.layout.replicas(self.tp_size, self.tp_rank)

    def counted_in_norm(self) -> bool:
        """Whether this rank's copy counts in the global gradient norm (each value once)."""
        if self.pipeline_copy == "other":
            return False
        return self.tp_dim is not None or self.tp_rank == 0


def default_meta(name: str, param: torch.Tensor) -> ParamMeta:
    """The record of a parameter no plan style touched: whole on every rank; weight decay on
    matrices only (Megatron's split: decaying 1-D biases and norm gains fights the normalization)."""
    return ParamMeta(tuple(param.shape), weight_decay=param.dim() >= 2)


@runtime_checkable
class StepStatistics(Protocol):
    """A module that learns from each step's tokens other than by gradient (a router's expert
    bias): ``step_statistics()`` is its tensor summed over this rank's micro batches of the step
    (None: nothing to do); after the optimizer step the runner sums it over the ranks that saw
    other tokens and hands the total to ``apply_step_statistics``."""

    def step_statistics(self) -> torch.Tensor | None: ...
    def apply_step_statistics(self, total: torch.Tensor) -> None: ...


# ---------------------------------------------------------------------- pipeline pieces


@dataclass(frozen=True)
class PipelinePieces:
    """Which submodules (by attribute name) the first stage needs (``embed``), the attribute
    holding the ordered blocks, and what the last stage needs (``head``). A module in both
    ``embed`` and ``head`` (a tied embedding) is held by the first and the last stage."""

    embed: tuple[str, ...]
    blocks: str
    head: tuple[str, ...]


class ModelFamily(nn.Module):
    """Base of every model family: the contract's methods, and block recompute shared by all.

    Subclasses implement the ``NotImplementedError`` methods; ``forward_blocks`` is what both
    the family's own ``forward`` and every pipeline stage call, so activation recompute applies
    the same way whatever the layout.
    """

    recompute: Any = None  # (granularity, method, num_layers) when full recompute is on
    weight_init: Any = None  # models.init.WeightInit: how its parameters are drawn, whole or one shard at a time

    def parallel_plan(self) -> Plan:
        raise NotImplementedError

    def pipeline_pieces(self) -> PipelinePieces:
        raise NotImplementedError

    def embed(self, batch: Batch) -> Carry:
        raise NotImplementedError

    def block_inputs(self, batch: Batch) -> dict[str, Any]:
        """What every block reads besides the carry (positions, rope tables, masks)."""
        raise NotImplementedError

    def run_blocks(self, carry: Carry, inputs: dict[str, Any], blocks: list[nn.Module]) -> tuple[Carry, dict[str, torch.Tensor]]:
        """Run ``blocks`` in order; returns the new carry and the auxiliary loss terms they produced."""
        raise NotImplementedError

    def head(self, carry: Carry, batch: Batch) -> Any:
        raise NotImplementedError

    def loss(self, batch: Batch, outputs: Any) -> LossOutput:
        raise NotImplementedError

    def loss_count(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def carry_shapes(self, batch: Batch, seq_shards: int) -> dict[str, tuple[int, ...]]:
        """Shapes of the carry leaving any block for micro batch ``batch`` (already cut to this
        context-parallel rank's tokens), with the sequence split ``seq_shards`` ways under
        sequence parallelism: the receiving stage allocates its buffers from them."""
        raise NotImplementedError

    def blocks(self) -> nn.Module:
        return getattr(self, self.pipeline_pieces().blocks)

    def prepare_batch(self, batch: Batch) -> Batch:
        """The batch with what the model derives from whole sequences (multi-token prediction's
        shifted targets), before the runner cuts it for context parallelism. Unchanged by default."""
        return batch

    def pretrained_encoders(self) -> tuple[str, ...]:
        """Submodules (by name) that ``--bert-load`` starts from a BERT checkpoint: each holds
        BERT's body under BERT's parameter names (the retriever's towers). None by default."""
        return ()

    def run_stage(self, carry: Carry | None, batch: Batch, blocks: list[nn.Module], is_first: bool,
                  is_last: bool) -> tuple[Any, dict[str, torch.Tensor]]:  # fmt: skip
        """A contiguous run of ``blocks``, after the embedding when ``is_first`` and before the head
        when ``is_last``: what a pipeline stage (or, whole, the one-process model) computes. The
        carry in (None on the first) -> the carry out, or the head's outputs on the last; and
        the auxiliary terms of the blocks. One method, so FSDP can treat it as a forward."""
        if is_first:
            carry = self.embed(batch)
        carry, aux = self.forward_blocks(carry, self.block_inputs(batch), blocks)
        return (self.head(carry, batch) if is_last else carry), aux

    def forward_blocks(self, carry: Carry, inputs: dict[str, Any], blocks: list[nn.Module]) -> tuple[Carry, dict[str, torch.Tensor]]:
        """``run_blocks`` under the model's recompute policy (``--recompute-granularity full``,
        with gradients on): spans of blocks run inside activation checkpoints, which keep only
        their inputs and rerun the forward in backward with the same random state. ``uniform``:
        every run of ``num_layers`` blocks is one checkpoint; ``block``: the first ``num_layers``
        blocks one by one, the rest keep their activations."""
        if self.recompute is None or not torch.is_grad_enabled():
            return self.run_blocks(carry, inputs, blocks)
        method, n = self.recompute
        if method == "uniform":
            spans = [(i, min(i + n, len(blocks))) for i in range(0, len(blocks), n)]
            plain = len(blocks)
        else:
            spans = [(i, i + 1) for i in range(min(n, len(blocks)))]
            plain = min(n, len(blocks))
        aux: dict[str, torch.Tensor] = {}
        for start, end in spans:
            carry, span_aux = checkpoint(self.run_blocks, carry, inputs, blocks[start:end], use_reentrant=False,
                                         context_fn=functools.partial(recompute_contexts, blocks[start:end]))  # fmt: skip
            _add_terms(aux, span_aux)
        if plain < len(blocks):
            carry, span_aux = self.run_blocks(carry, inputs, blocks[plain:])
            _add_terms(aux, span_aux)
        return carry, aux


class TokenLossModel(ModelFamily):
    """What every language model whose head returns per-token losses (or their ``SummedTokenLoss``)
    shares: the loss is the sum over the batch's ``loss_mask``, normalized by its count, and the
    carry between stages is the hidden states ``{"hidden": [b, s / seq_shards, hidden_size]}``.
    Set ``hidden_size``."""

    hidden_size: int = 0

    def loss(self, batch: Batch, outputs: torch.Tensor | SummedTokenLoss | HeadWithAux) -> LossOutput:
        aux = {}
        if isinstance(outputs, HeadWithAux):
            outputs, aux = outputs.outputs, outputs.aux
        mask = batch["loss_mask"]
        total = outputs.total if isinstance(outputs, SummedTokenLoss) else (outputs * mask).sum()
        return LossOutput(total=total, count=mask.sum(), aux=aux)

    def loss_count(self, batch: Batch) -> torch.Tensor:
        return batch["loss_mask"].sum()

    def carry_shapes(self, batch: Batch, seq_shards: int) -> dict[str, tuple[int, ...]]:
        b, s = batch["tokens"].shape
        return {"hidden": (b, s // seq_shards, self.hidden_size)}


def _add_terms(into: dict[str, torch.Tensor], terms: dict[str, torch.Tensor]) -> None:
    for name, value in terms.items():
        into[name] = into[name] + value if name in into else value

