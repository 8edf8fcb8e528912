"""Pipeline parallelism: a decoder cut into stages over ``mesh.pp``, and the schedules that run them.

Every rank builds the same full ``Decoder`` (initialization is layout-invariant), applies tensor
parallelism if any, then ``build_stage_modules`` keeps this rank's model chunks and drops the
rest. The ``Decoder`` object stays the owner of this rank's parameters under their one-process
names (``layers.5.mlp...`` stays ``layers.5``), so the optimizer, gradient norm and checkpoints
work on it by name whatever the layout; the ``PipelineStage`` modules it returns are views of
it that the schedules run, one per model chunk.

The schedules' orders and messages are pure data (``pipeline_schedules``); this module only
walks them: before each unit of work it posts one ``batch_isend_irecv`` of activations and
gradients with its neighbours, into buffers whose shapes come from the micro batch and the
model, so no shape is ever exchanged.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from meshtron.models.decoder import Decoder
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.pipeline_schedules import Message, communication_plan, split_layers

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Batch], torch.Tensor]


class PipelineStage(nn.Module):
    """One model chunk: the embedding if it is the model's first, a contiguous run of blocks, and
    the final norm with the loss if it is the last.

    Submodules are the decoder's own, under the decoder's names, so the stage's parameters are the
    decoder's. Tied embeddings: the last chunk also holds ``embedding``, whose weight it uses as
    the output projection (through the decoder's ``output_loss``, tensor-parallel or not); on its
    own rank that is a copy of the first chunk's, kept equal by ``allreduce_tied_embedding_grads``.
    """

    def __init__(self, model: Decoder, layers: range, is_first: bool, is_last: bool, seq_divisor: int):
        super().__init__()
        self.layer_ids, self.is_first, self.is_last = layers, is_first, is_last
        self.tied = model.output is None
        self.hidden_size, self.seq_divisor = model.cfg.hidden_size, seq_divisor
        if is_first or (is_last and self.tied):
            self.embedding = model.embedding
        if is_first:
            self.position_embedding, self.embedding_dropout = model.position_embedding, model.embedding_dropout
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if is_last:
            self.final_norm, self.output = model.final_norm, model.output
            self._output_loss = model.output_loss
        self._rope_tables = model.rope_tables if model.use_rope else None

    def activation_shape(self, tokens: torch.Tensor) -> tuple[int, int, int]:
        """[b, s, h] of the hidden states entering or leaving this chunk for micro batch ``tokens``
        ([b, s]); the sequence is 1/tp of it under sequence parallelism."""
        return tokens.shape[0], tokens.shape[1] // self.seq_divisor, self.hidden_size

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """The previous chunk's hidden states (None on the first) -> hidden states, or on the last
        chunk the per-token loss [b, s] (fp32), as ``Decoder.forward`` computes them."""
        tokens = batch["tokens"]
        position_ids, document_ids = batch.get("position_ids"), batch.get("document_ids")
        if self.is_first:
            hidden = self.embedding(tokens)
            if self.position_embedding is not None:
                positions = position_ids
                if positions is None:
                    positions = torch.arange(tokens.shape[1], device=tokens.device)
                hidden = hidden + self.position_embedding(positions)
            hidden = self.embedding_dropout(hidden)
        cos, sin = self._rope_tables(tokens.device) if self._rope_tables is not None else (None, None)
        for layer in self.layers.values():
            hidden = layer(hidden, cos, sin, position_ids, document_ids)
        if self.is_last:
            return self._output_loss(self.final_norm(hidden), batch["labels"])
        return hidden


def build_stage_modules(model: Decoder, mesh: Mesh, virtual_size: int = 1, first_stage_layers: int | None = None,
                        last_stage_layers: int | None = None, account_for_embedding: bool = False,
                        account_for_loss: bool = False) -> list[PipelineStage]:  # fmt: skip
    """This rank's model chunks (chunk ``v`` of rank ``r`` is model chunk ``v * pp + r``), and
    ``model`` cut down in place to their parameters. Apply tensor parallelism first.

    After the call ``model`` is this rank's share of the model, under one-process names: build the
    optimizer and checkpoints from it, run it only through the schedules (calling it raises).
    Tied embeddings with pp > 1: the first and the last stage both hold ``embedding.weight``
    (marked ``shared_embedding``); it counts once in a gradient norm (on the first stage).
    """
    pp = mesh.pp_size
    ranges = split_layers(len(model.layers), pp, virtual_size, first_stage_layers, last_stage_layers, account_for_embedding, account_for_loss)
    last_chunk = pp * virtual_size - 1
    seq_divisor = mesh.tp_size if getattr(model.embedding, "sequence_parallel", False) else 1
    chunks = [v * pp + mesh.pp_rank for v in range(virtual_size)]
    stages = [PipelineStage(model, ranges[c], c == 0, c == last_chunk, seq_divisor) for c in chunks]
    if pp == 1:
        return stages
    first, last = stages[0].is_first, stages[-1].is_last
    if model.output is None and (first or last):
        model.embedding.weight.shared_embedding = True
    elif not first:
        model.embedding = None
    if not first:
        model.position_embedding = None
    if not last:
        model.final_norm, model.output = None, None
    model.layers = nn.ModuleDict({str(i): model.layers[i] for c in chunks for i in ranges[c]})
    model.register_forward_pre_hook(_refuse_direct_call)
    # NCCL's first call on a group must involve all its ranks; the schedules' first transfers
    # involve only some, so this collective sets the group up.
    device = next(model.parameters()).device
    dist.all_reduce(torch.zeros(1, device=device), group=mesh.pp_group)
    return stages


def _refuse_direct_call(module: nn.Module, args) -> None:
    raise RuntimeError("this Decoder holds only this rank's pipeline stages: run it through "
                       "meshtron.parallel.pipeline's forward_backward_* schedules")  # fmt: skip


# ---------------------------------------------------------------------- schedules


def forward_backward_afab(stages, micro_batches, mesh, loss_fn, dtype, **kwargs) -> list[torch.Tensor] | None:
    """All forwards, then all backwards (GPipe): the reference schedule. See ``forward_backward``."""
    return forward_backward("afab", stages, micro_batches, mesh, loss_fn, dtype, **kwargs)


def forward_backward_1f1b(stages, micro_batches, mesh, loss_fn, dtype, **kwargs) -> list[torch.Tensor] | None:
    """1F1B: ``pp - rank - 1`` warm-up forwards, then alternate, then cool down. See ``forward_backward``."""
    return forward_backward("1f1b", stages, micro_batches, mesh, loss_fn, dtype, **kwargs)


def forward_backward_interleaved(stages, micro_batches, mesh, loss_fn, dtype, **kwargs) -> list[torch.Tensor] | None:
    """Megatron's interleaved 1F1B over ``len(stages)`` virtual stages per rank (micro batches a
    multiple of pp). See ``forward_backward``."""
    return forward_backward("interleaved", stages, micro_batches, mesh, loss_fn, dtype, **kwargs)


def forward_backward(
    kind: str,
    stages: list[PipelineStage],
    micro_batches: list[Batch],
    mesh: Mesh,
    loss_fn: LossFn,
    dtype: torch.dtype,
    *,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    no_sync: Callable[[], ContextManager] | None = None,
    forward_only: bool = False,
) -> list[torch.Tensor] | None:
    """Run schedule ``kind`` over this step's ``micro_batches`` (every pipeline rank passes the
    same ones) and accumulate gradients into the stages' parameters.

    ``loss_fn(per_token_loss, batch)`` is called on the last stage and returns the micro batch's
    loss as it is to be backwarded (e.g. masked sum / tokens of the whole global batch);
    ``scale_loss`` (the optimizer's) scales it for backward only. ``dtype``: the hidden states'
    dtype (the model's). ``no_sync`` (the optimizer's): every backward but each chunk's last runs
    inside it, so gradients are reduced over data parallel once. ``forward_only``: evaluation,
    no graph kept. Returns ``loss_fn``'s values (detached) per micro batch on the last stage,
    None elsewhere; ``pipeline_loss`` sums them onto every rank.
    """
    pp, rank, virtual = mesh.pp_size, mesh.pp_rank, len(stages)
    plan = communication_plan(kind, pp, rank, len(micro_batches), virtual, forward_only)
    last_backward = {op[2]: op for step in plan for op in step.ops if op[0] == "B"}
    run = _Run(stages, micro_batches, mesh, dtype, keep_graph=not forward_only)
    losses: list[torch.Tensor | None] = [None] * len(micro_batches)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for step in plan:
            run.exchange(step.batch)
            for op in step.ops:
                kind_, mb, v = op
                if kind_ == "B":
                    with contextlib.nullcontext() if no_sync is None or last_backward[v] == op else no_sync():
                        run.backward(mb, v)
                    continue
                out = run.forward(mb, v)
                if stages[v].is_last:
                    loss = loss_fn(out, micro_batches[mb])
                    losses[mb] = loss.detach()
                    out = loss if scale_loss is None else scale_loss(loss)
                if not (forward_only and stages[v].is_last):
                    run.outputs[(mb, v)] = out
    return losses if stages[-1].is_last else None


class _Run:
    """The tensors of one schedule run, keyed by (micro batch, local chunk): received inputs (until
    their gradient is sent), outputs (until their backward; forward-only, until sent) and received
    output gradients (until their backward)."""

    def __init__(self, stages: list[PipelineStage], micro_batches: list[Batch], mesh: Mesh, dtype: torch.dtype,
                 keep_graph: bool):  # fmt: skip
        self.stages, self.micro_batches, self.mesh, self.dtype = stages, micro_batches, mesh, dtype
        self.pp, self.keep_graph = mesh.pp_size, keep_graph
        self.pp_ranks = _pp_ranks(mesh)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.out_grads: dict[tuple[int, int], torch.Tensor] = {}

    def forward(self, mb: int, v: int) -> torch.Tensor:
        x = self.inputs.get((mb, v)) if self.keep_graph else self.inputs.pop((mb, v), None)
        if x is not None and self.keep_graph:
            x.requires_grad_()
        return self.stages[v](x, self.micro_batches[mb])

    def backward(self, mb: int, v: int) -> None:
        out = self.outputs.pop((mb, v))
        torch.autograd.backward(out, grad_tensors=self.out_grads.pop((mb, v), None))

    def exchange(self, batch: list[Message]) -> None:
        """Post ``batch`` as one group of transfers and wait for all of them."""
        if not batch:
            return
        ops = []
        for msg in batch:
            tensor = self._send_tensor(msg) if msg.send else self._recv_buffer(msg)
            op = dist.isend if msg.send else dist.irecv
            ops.append(dist.P2POp(op, tensor, peer=self.pp_ranks[msg.peer], group=self.mesh.pp_group))
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    def _local(self, chunk: int) -> int:
        return chunk // self.pp

    def _send_tensor(self, msg: Message) -> torch.Tensor:
        key = (msg.mb, self._local(msg.chunk))
        if msg.kind == "act":
            tensor = (self.outputs[key] if self.keep_graph else self.outputs.pop(key)).detach()
        else:
            tensor = self.inputs.pop(key).grad
        expected = self.stages[key[1]].activation_shape(self.micro_batches[msg.mb]["tokens"])
        if tuple(tensor.shape) != expected or tensor.dtype != self.dtype:
            raise RuntimeError(f"pipeline {msg.kind} of micro batch {msg.mb} from model chunk {msg.chunk} is "
                               f"{tuple(tensor.shape)} {tensor.dtype}, but the next stage expects {expected} "
                               f"{self.dtype} (is dtype the model's, and sequence parallelism applied?)")  # fmt: skip
        return tensor.contiguous()

    def _recv_buffer(self, msg: Message) -> torch.Tensor:
        # An activation goes to the chunk after its producer, a gradient to the one before.
        chunk = msg.chunk + 1 if msg.kind == "act" else msg.chunk - 1
        key = (msg.mb, self._local(chunk))
        tokens = self.micro_batches[msg.mb]["tokens"]
        buffer = torch.empty(self.stages[key[1]].activation_shape(tokens), dtype=self.dtype, device=tokens.device)
        (self.inputs if msg.kind == "act" else self.out_grads)[key] = buffer
        return buffer


# ---------------------------------------------------------------------- after the schedule


@torch.no_grad()
def allreduce_tied_embedding_grads(stages: list[PipelineStage], mesh: Mesh) -> None:
    """Sum the tied embedding's gradient between the first stage (its lookup's part) and the last
    (its output projection's part), so both copies take the same step (Megatron's embedding group).

    Call on every rank after the schedule and the data-parallel reduction (the optimizer's
    ``finish_grad_sync``), before the step; a no-op on ranks without a copy. The two ranks swap
    their gradients point to point and each adds the other's, so both hold bitwise the same sum.
    Reads ``param.main_grad`` (the optimizer's fp32 buffer) where there is one, else ``.grad``.
    """
    if mesh.pp_size == 1:
        return
    shared = [s.embedding.weight for s in stages if s.tied and (s.is_first or s.is_last)]
    if not shared:
        return
    (param,) = shared
    grad = getattr(param, "main_grad", None)
    grad = param.grad if grad is None else grad
    if grad is None:
        raise RuntimeError("the tied embedding has no gradient: run the schedule's backward first")
    pp_ranks = _pp_ranks(mesh)
    peer = pp_ranks[-1] if mesh.is_first_stage else pp_ranks[0]
    theirs = torch.empty_like(grad)
    ops = [dist.P2POp(dist.isend, grad, peer=peer, group=mesh.pp_group),
           dist.P2POp(dist.irecv, theirs, peer=peer, group=mesh.pp_group)]  # fmt: skip
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    grad.add_(theirs)


def pipeline_loss(losses: list[torch.Tensor] | None, mesh: Mesh, device: torch.device) -> torch.Tensor:
    """The step's loss (sum of the schedule's per-micro-batch values) on every pipeline rank, sent
    from the last stage, so every rank can log and return it. Collective over pp."""
    total = torch.stack(losses).sum().float() if losses is not None else torch.zeros((), device=device)
    if mesh.pp_size > 1:
        dist.broadcast(total, src=_pp_ranks(mesh)[-1], group=mesh.pp_group)
    return total


def _pp_ranks(mesh: Mesh) -> list[int]:
    """Global ranks of this rank's pipeline group, by pipeline rank (what ``P2POp`` peers are)."""
    return next(g for g in mesh.group_ranks("pp") if mesh.rank in g)
