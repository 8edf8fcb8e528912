"""Pipeline parallelism: a model cut into stages over ``mesh.pp``, and the schedules that run them.

Every rank builds the same full model (initialization is layout-invariant) and applies its
parallel plan; ``build_stages`` then keeps this rank's model chunks and drops the rest. A chunk
is the model's own pieces (``pipeline_pieces``): the embedding pieces if it is the first, a
contiguous run of blocks, the head pieces if it is the last. The model object stays the owner of
this rank's parameters under their one-process names (``layers.5.mlp...`` stays ``layers.5``),
so the optimizer, gradient norm and checkpoints work on it by name whatever the layout.

A stage runs the model's own ``embed`` / ``forward_blocks`` / ``head``, the very methods its
one-process forward runs, so nothing (activation recompute included) differs under pp. The
tensors between stages are the model's ``carry`` dict, shaped by ``carry_shapes``.

The schedules' orders and messages are pure data (``pipeline_schedules``); this module only
walks them: before each unit of work it posts one ``batch_isend_irecv`` of activations and
gradients with its neighbours, into buffers whose shapes come from the micro batch and the
model, so no shape is ever exchanged; every link they use is opened once, at set-up
(``connect_links``). Under the zero-bubble schedules a backward is two ops: ``B`` runs the stage's
backward with the weight-gradient GEMMs kept aside (``kernels.deferred_wgrad``) and ``W`` runs them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from meshtron.kernels.deferred_wgrad import WeightGradStore
from meshtron.models import contract as mc
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.pipeline_schedules import (
    SPLIT_BACKWARD,
    Message,
    Op,
    Step,
    chunk_place,
    communication_plan,
    local_consumer,
    model_chunk,
    p2p_links,
    split_layers,
)


class Stage:
    """One model chunk of ``model``: ``blocks`` (modules, in order), with the embedding pieces
    when ``is_first`` and the head pieces when ``is_last``."""

    def __init__(self, model: mc.ModelFamily, blocks: list[nn.Module], is_first: bool, is_last: bool):
        self.model, self.blocks, self.is_first, self.is_last = model, blocks, is_first, is_last

    def forward(self, carry: mc.Carry | None, batch: mc.Batch) -> tuple[Any, dict[str, torch.Tensor]]:
        """The previous chunk's carry (None on the first) -> this chunk's carry, or on the last
        the head's outputs; and the auxiliary loss terms its blocks produced."""
        return self.model.run_stage(carry, batch, self.blocks, self.is_first, self.is_last)


def build_stages(model: mc.ModelFamily, metas: dict[str, mc.ParamMeta], mesh: Mesh, split: list[range] | None = None,
                 device: torch.device | None = None, kind: str = "1f1b") -> list[Stage]:  # fmt: skip
    """This rank's model chunks (chunk ``v`` of rank ``r`` is model chunk ``v * pp + r``; under
    schedule ``kind`` zbv, ``r`` and ``2 pp - 1 - r``), with ``model`` cut down in place to their
    parameters and ``metas`` to their records. ``split``: the blocks of every model chunk in model
    order (``pipeline_balance.pipeline_split``), any sizes; None: one chunk per rank, even.

    A piece both the first and the last stage need (a tied embedding, used as the output
    projection) is kept on both: its record says which copy is the first (``pipeline_copy``), so
    its gradient is counted once and the copies are summed after backward. Where one rank holds
    both ends (zbv's rank 0) it is one parameter, as in one process. ``device``: where the
    stages will run (default: the model's; a model still on the meta device must name it).
    """
    pp, pieces, all_blocks = mesh.pp, model.pipeline_pieces(), model.blocks()
    ranges = split if split is not None else split_layers(len(all_blocks), pp)
    virtual_size = len(ranges) // pp
    last_chunk = pp * virtual_size - 1
    chunks = [model_chunk(kind, pp, mesh.pp_rank, v) for v in range(virtual_size)]
    stages = [Stage(model, [all_blocks[i] for i in ranges[c]], c == 0, c == last_chunk) for c in chunks]
    if pp == 1:
        return stages
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    keep = set(pieces.embed if first else ()) | set(pieces.head if last else ())
    shared = set(pieces.embed) & set(pieces.head) & keep if not (first and last) else set()
    for name in sorted((set(pieces.embed) | set(pieces.head)) - keep):
        setattr(model, name, None)
    setattr(model, pieces.blocks, nn.ModuleDict({str(i): all_blocks[i] for c in chunks for i in ranges[c]}))
    held = dict(model.named_parameters())
    for name in list(metas):
        if name not in held:
            del metas[name]
        elif name.split(".")[0] in shared:
            metas[name].pipeline_copy = "first" if first else "other"
    model.register_forward_pre_hook(_refuse_direct_call)
    # NCCL's first call on a group must involve all its ranks; the schedules' first transfers
    # involve only some, so this collective sets the group up.
    device = device or next(model.parameters()).device
    dist.all_reduce(torch.zeros(1, device=device), group=mesh.pp_group)
    connect_links(mesh, kind, virtual_size, device)
    return stages


def connect_links(mesh: Mesh, kind: str, virtual: int, device: torch.device) -> None:
    """Open every point-to-point link schedule ``kind`` uses (``p2p_links``) in one group of
    transfers that every pipeline rank posts at once: one element sent over each link this rank
    sends on, one received over each it receives on.

    Why: NCCL connects two ranks at their first transfer, inside that group call, by a handshake
    that assumes the two sides connect mirrored directions in the same call
    (``ncclTransportP2pSetup``). The schedules' first transfers are not mirrored so: with one micro batch, 1F1B's rank 0
    sends its activation and receives its gradient in one group, while rank 1 receives it, and
    sends the gradient in a later group. On a two-rank group the handshake then reads a longer
    message than it expects ("Message truncated", ncclInternalError); on more ranks both wait in
    it for good. Connected here, the schedules never connect anything."""
    ranks, me = pp_ranks(mesh), mesh.pp_rank
    ops = []
    for sender, receiver in p2p_links(kind, mesh.pp, virtual):
        if sender == me:
            ops.append(dist.P2POp(dist.isend, torch.zeros(1, device=device), peer=ranks[receiver], group=mesh.pp_group))
        elif receiver == me:
            ops.append(dist.P2POp(dist.irecv, torch.empty(1, device=device), peer=ranks[sender], group=mesh.pp_group))
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def _refuse_direct_call(module: nn.Module, args) -> None:
    raise RuntimeError("this model holds only this rank's pipeline stages: run it through meshtron.parallel.runner")


# ---------------------------------------------------------------------- schedules

# ``forward_step(stage, carry, micro_batch_index)`` -> (carry for the next stage, or None on the
# last; objective to backward on this stage, or None): the runner's, which computes losses.
ForwardStep = Callable[[Stage, "mc.Carry | None", int], tuple["mc.Carry | None", "torch.Tensor | None"]]


def forward_backward(
    kind: str,
    stages: list[Stage],
    micro_batches: list[mc.Batch],
    mesh: Mesh,
    forward_step: ForwardStep,
    dtype: torch.dtype,
    seq_shards: int = 1,
    *,
    no_sync: Callable[[], ContextManager] | None = None,
    forward_only: bool = False,
    timed: Callable[[str], ContextManager] | None = None,
) -> None:
    """Run schedule ``kind`` over this step's ``micro_batches`` (every pipeline rank passes the
    same ones) and accumulate gradients into the stages' parameters.

    ``forward_step`` runs a stage on a micro batch and returns what goes on and the objective
    that stage backwards (the loss on the last stage, auxiliary terms anywhere, scaled for
    backward). ``dtype``: the carry's dtype (the model's); ``seq_shards``: how many ways the
    carry's sequence is split (tp under sequence parallelism). ``no_sync`` (the optimizer's):
    every backward but each chunk's last runs inside it (``_synced``), so gradients are reduced
    over data parallel once. ``forward_only``: evaluation, no graph kept. ``timed(name)``: a
    context around each micro batch's "forward" and "backward" (``--log-straggler``'s sections;
    a split backward's ``W`` counts as backward).
    """
    pp, rank, virtual = mesh.pp, mesh.pp_rank, len(stages)
    plan = communication_plan(kind, pp, rank, len(micro_batches), virtual, forward_only)
    synced = _synced(plan, stages)
    store = WeightGradStore() if kind in SPLIT_BACKWARD and not forward_only else None
    run = _Run(kind, stages, micro_batches, mesh, dtype, seq_shards, keep_graph=not forward_only)
    section = timed or (lambda _: contextlib.nullcontext())
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for step in plan:
            run.exchange(step.batch)
            for op in step.ops:
                kind_, mb, v = op
                if kind_ == "F":
                    with section("forward"):
                        carry, objective = forward_step(stages[v], run.take_input(mb, v), mb)
                    if not (forward_only and carry is None):
                        run.outputs[(mb, v)] = (carry, objective)
                else:
                    with section("backward"), contextlib.nullcontext() if no_sync is None or op in synced else no_sync():
                        if kind_ == "W":
                            store.run((mb, v))
                        elif store is not None:  # the input gradient; weight gradients wait for W
                            with store.record((mb, v)):
                                run.backward(mb, v)
                        else:
                            run.backward(mb, v)
                run.hand_over(op)
    if store is not None:
        store.check_empty()


def _synced(plan: list[Step], stages: list[Stage]) -> set[Op]:
    """The ops that reduce gradients over data parallel: each chunk's last backward (and, with the
    backward split, its last ``W``), every parameter's gradient being complete after it. Where a
    rank holds both ends of the model (zbv's rank 0: a tied embedding is one parameter of two
    chunks) only its last backward and last ``W`` of all chunks: the other chunks' gradients are
    then reduced after the schedule (``finish_grad_sync``), never twice."""
    both_ends = len(stages) > 1 and any(s.is_first for s in stages) and any(s.is_last for s in stages)
    last: dict[tuple[str, int], Op] = {}
    for step in plan:
        for op in step.ops:
            if op[0] != "F":
                last[(op[0], 0 if both_ends else op[2])] = op
    return set(last.values())


def last_stage_rank(kind: str, mesh: Mesh, virtual: int) -> int:
    """The global rank of this rank's pipeline group that computes the loss (holds the last chunk)."""
    return pp_ranks(mesh)[chunk_place(kind, mesh.pp, mesh.pp * virtual - 1)[0]]


class _Run:
    """The tensors of one schedule run, keyed by (micro batch, local chunk): received inputs (until
    their gradient is sent), outputs (until their backward, their values released once sent;
    forward-only, until sent) and received output gradients (until their backward)."""

    def __init__(self, kind: str, stages: list[Stage], micro_batches: list[mc.Batch], mesh: Mesh, dtype: torch.dtype,
                 seq_shards: int, keep_graph: bool):  # fmt: skip
        self.kind, self.stages, self.micro_batches, self.mesh, self.dtype = kind, stages, micro_batches, mesh, dtype
        self.pp, self.seq_shards, self.keep_graph = mesh.pp, seq_shards, keep_graph
        self.pp_ranks = pp_ranks(mesh)
        self.inputs: dict[tuple[int, int], mc.Carry] = {}
        self.outputs: dict[tuple[int, int], tuple[mc.Carry | None, torch.Tensor | None]] = {}
        self.out_grads: dict[tuple[int, int], mc.Carry] = {}
        self.releasable: dict[int, set[str]] = {}  # by local chunk: carry names freed once sent

    def take_input(self, mb: int, v: int) -> mc.Carry | None:
        carry = self.inputs.get((mb, v)) if self.keep_graph else self.inputs.pop((mb, v), None)
        if carry is not None and self.keep_graph:
            for t in carry.values():
                t.requires_grad_(t.is_floating_point())
        return carry

    def hand_over(self, op: Op) -> None:
        """Where ``op``'s output goes to another chunk of this rank (the V's turn), hand it over
        without a message: a forward's output, detached, as that chunk's input (so each chunk's
        backward stays its own), a backward's input gradient as that chunk's output gradient."""
        kind, mb, v = op
        target = local_consumer(op, self.pp, self.mesh.pp_rank, len(self.stages), self.kind)
        if target is None:
            return
        if kind == "F":
            carry = self.outputs[(mb, v)][0] if self.keep_graph else self.outputs.pop((mb, v))[0]
            self.inputs[(mb, target)] = {name: t.detach() for name, t in carry.items()}
        else:
            self.out_grads[(mb, target)] = {name: t.grad for name, t in self.inputs.pop((mb, v)).items()}

    def backward(self, mb: int, v: int) -> None:
        carry, objective = self.outputs.pop((mb, v))
        grads = self.out_grads.pop((mb, v), {})
        tensors, grad_tensors = [], []
        for name in sorted(carry or {}):
            if carry[name].requires_grad:
                tensors.append(carry[name])
                grad_tensors.append(grads[name])
        if objective is not None and objective.requires_grad:
            tensors.append(objective)
            grad_tensors.append(None)
        if tensors:
            # The autograd engine itself: ``torch.autograd.backward`` would refuse a gradient whose
            # shape differs from an output released after its send.
            grad_tensors = [torch.ones_like(t) if g is None else g for t, g in zip(tensors, grad_tensors)]
            torch.autograd.Variable._execution_engine.run_backward(
                tuple(tensors), tuple(grad_tensors), False, False, (), allow_unreachable=True, accumulate_grad=True)

    def exchange(self, batch: list[Message]) -> None:
        """Post ``batch`` as one group of transfers (one per carry tensor) and wait for all of them."""
        if not batch:
            return
        ops = []
        for msg in batch:
            carry = self._send_carry(msg) if msg.send else self._recv_buffers(msg)
            op = dist.isend if msg.send else dist.irecv
            for name in sorted(carry):
                ops.append(dist.P2POp(op, carry[name], peer=self.pp_ranks[msg.peer], group=self.mesh.pp_group))
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        if self.keep_graph:
            for msg in batch:
                if msg.send and msg.kind == "act":
                    v = self._local(msg.chunk)
                    carry, objective = self.outputs[(msg.mb, v)]
                    if v not in self.releasable:  # a chunk's graph has the same shape for every micro batch
                        self.releasable[v] = releasable(carry, objective)
                    for name in self.releasable[v]:
                        t = carry[name]
                        if t.grad_fn is not None and t._base is None:
                            t.data = torch.empty((1,), dtype=t.dtype, device=t.device)

    def _expected(self, mb: int, v: int) -> dict[str, tuple[int, ...]]:
        return self.stages[v].model.carry_shapes(self.micro_batches[mb], self.seq_shards)

    def _local(self, chunk: int) -> int:
        return chunk_place(self.kind, self.pp, chunk)[1]

    def _send_carry(self, msg: Message) -> mc.Carry:
        key = (msg.mb, self._local(msg.chunk))
        if msg.kind == "act":
            carry, _ = self.outputs[key] if self.keep_graph else self.outputs.pop(key)
            carry = {name: t.detach() for name, t in carry.items()}
        else:
            carry = {name: t.grad for name, t in self.inputs.pop(key).items()}
        expected = self._expected(*key)
        got = {name: tuple(t.shape) for name, t in carry.items()}
        if got != expected or any(t.dtype != self.dtype for t in carry.values()):
            raise RuntimeError(f"pipeline {msg.kind} of micro batch {msg.mb} from model chunk {msg.chunk} is {got} "
                               f"{[t.dtype for t in carry.values()]}, but the next stage expects {expected} "
                               f"{self.dtype} (is dtype the model's, and sequence parallelism applied?)")  # fmt: skip
        return {name: t.contiguous() for name, t in carry.items()}

    def _recv_buffers(self, msg: Message) -> mc.Carry:
        # An activation goes to the chunk after its producer, a gradient to the one before.
        chunk = msg.chunk + 1 if msg.kind == "act" else msg.chunk - 1
        key = (msg.mb, self._local(chunk))
        device = self.micro_batches[msg.mb][next(iter(self.micro_batches[msg.mb]))].device
        buffers = {name: torch.empty(shape, dtype=self.dtype, device=device) for name, shape in self._expected(*key).items()}
        (self.inputs if msg.kind == "act" else self.out_grads)[key] = buffers
        return buffers


def releasable(carry: mc.Carry, objective: torch.Tensor | None) -> set[str]:
    """The carry tensors whose memory can be freed once sent while keeping their place in the graph
    (Megatron's ``deallocate_output_tensor``): their backward needs only their ``grad_fn`` and the
    gradient the next stage sends back, never their values, so until then each holds one element
    instead of ``[b, s, h]``. Not: an input passed through unchanged (no ``grad_fn``: the previous
    stage's buffer), a view (its storage is its base's), or a tensor this chunk also fed to an op
    that may have saved it (T5's encoder output read by the decoder blocks of the same chunk),
    found by walking the graph of the other outputs."""
    names = set()
    for name, t in carry.items():
        if t.grad_fn is None or t._base is not None:
            continue
        others = [u.grad_fn for other, u in carry.items() if other != name and u.grad_fn is not None]
        if objective is not None and objective.grad_fn is not None:
            others.append(objective.grad_fn)
        if not _reaches(others, t.grad_fn):
            names.add(name)
    return names


def _reaches(roots: list, target) -> bool:
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node is target:
            return True
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return False


# ---------------------------------------------------------------------- after the schedule


@torch.no_grad()
def sum_stage_copies(grads: list[torch.Tensor], mesh: Mesh) -> None:
    """Sum the gradients of weights two pipeline stages hold (a tied embedding: the first stage's
    lookup part and the last's output projection part), so both copies take the same step
    (Megatron's embedding group). ``grads``: this rank's copies, in name order, on the first or
    the last stage; empty elsewhere. The two ranks swap them point to point and each adds the
    other's, so both hold bitwise the same sum."""
    if mesh.pp == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    ranks = pp_ranks(mesh)
    peer = ranks[-1] if mesh.is_first_stage else ranks[0]
    theirs = torch.empty_like(flat)
    ops = [dist.P2POp(dist.isend, flat, peer=peer, group=mesh.pp_group),
           dist.P2POp(dist.irecv, theirs, peer=peer, group=mesh.pp_group)]  # fmt: skip
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    for g, part in zip(grads, theirs.split([g.numel() for g in grads])):
        g.add_(part.view_as(g))


def pp_ranks(mesh: Mesh) -> list[int]:
    """Global ranks of this rank's pipeline group, by pipeline rank (what ``P2POp`` peers are)."""
    return next(g for g in mesh.group_ranks("pp") if mesh.rank in g)
