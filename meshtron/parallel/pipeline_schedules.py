"""Pipeline schedules as pure data: which layers each stage holds, in which order a rank runs its
forward and backward passes, and which messages it exchanges around each of them.

Nothing here touches tensors or processes, so every schedule can be printed, reasoned about and
tested for ordering and deadlock-freedom in one process (``run_plans`` runs every rank's plan
together, on a clock when given each op's cost); ``pipeline.py`` only walks the lists.

Vocabulary: ``pp`` pipeline ranks each hold ``virtual`` model chunks (interleaving); local chunk
``v`` of rank ``r`` is model chunk ``v * pp + r``, so model chunks go round the ranks as a ring and
an activation always travels to the next rank (pp - 1 wraps to 0), a gradient to the previous one.
Under ``zbv`` the two chunks of rank ``r`` are ``r`` and ``2 pp - 1 - r`` (a V: down the ranks and
back up, the turn on rank pp - 1 and the model's both ends on rank 0); where two consecutive chunks
sit on one rank (the turn) the tensor is handed over locally, with no message (``model_chunk`` /
``chunk_place`` say where a chunk is). An op is ``(kind, micro_batch, v)`` with ``v`` the local
chunk and kind ``"F"`` (forward), ``"B"`` (backward) or, in the zero-bubble schedules, whose
backward is split in two, ``"B"`` the input gradient alone and ``"W"`` the weight gradient
(``SPLIT_BACKWARD``).
"""

from __future__ import annotations

import bisect
import functools
from collections import deque
from typing import Callable, NamedTuple

KINDS = ("afab", "1f1b", "interleaved", "zb-h1", "zbv")
SPLIT_BACKWARD = ("zb-h1", "zbv")  # schedules whose "B" is the input gradient and "W" the weight gradient

Op = tuple[str, int, int]


def model_chunk(kind: str, pp: int, rank: int, v: int) -> int:
    """The model chunk that rank ``rank`` holds as local chunk ``v`` under schedule ``kind``."""
    if kind == "zbv":
        return rank if v == 0 else 2 * pp - 1 - rank
    return v * pp + rank


def chunk_place(kind: str, pp: int, chunk: int) -> tuple[int, int]:
    """(pipeline rank, local chunk) of model chunk ``chunk`` under schedule ``kind``."""
    if kind == "zbv":
        return (chunk, 0) if chunk < pp else (2 * pp - 1 - chunk, 1)
    return chunk % pp, chunk // pp


class Message(NamedTuple):
    """One point-to-point transfer. ``chunk`` is the model chunk that produced the tensor: an
    activation of micro batch ``mb`` leaving chunk ``c`` is ``("act", mb, c)`` on both ends."""

    send: bool
    kind: str  # "act" (forward activation) | "grad" (gradient of that activation)
    peer: int  # pipeline rank of the other end
    mb: int
    chunk: int


class Step(NamedTuple):
    """Post ``batch`` as one ``batch_isend_irecv`` and wait for it, then run ``ops`` (none in the
    trailing step that only sends the last outputs)."""

    batch: list[Message]
    ops: list[Op]


# ---------------------------------------------------------------------- stage split


def split_layers(num_layers: int, pp: int, virtual: int = 1, first_stage_layers: int | None = None,
                 last_stage_layers: int | None = None, account_for_embedding: bool = False,
                 account_for_loss: bool = False) -> list[range]:  # fmt: skip
    """Layers of each model chunk, in model order (``pp * virtual`` contiguous ranges).

    Even by default. ``first_stage_layers`` / ``last_stage_layers`` give pipeline rank 0 / pp - 1
    fewer (or more) layers than the rest, to balance the embedding and the output layer with its
    loss (Megatron's ``--decoder-first/last-pipeline-num-layers``); the other ranks share what is
    left evenly. A rank's layers are split evenly over its ``virtual`` chunks, so every count must
    divide as described by the error it raises otherwise.

    ``account_for_embedding`` / ``account_for_loss`` (Megatron's ``--account-for-*-in-pipeline-split``)
    count the embedding / the output layer with its loss as one more layer each, so the first /
    last *chunk* holds one real layer fewer: with virtual stages this balances the chunks, which
    per-rank counts cannot.
    """
    if pp < 1 or virtual < 1:
        raise ValueError(f"pipeline size {pp} and virtual stages {virtual} must be at least 1")
    if account_for_embedding or account_for_loss:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ValueError("--account-for-embedding/loss-in-pipeline-split does not combine with first/last stage layer counts")
        chunks, slots = pp * virtual, num_layers + int(account_for_embedding) + int(account_for_loss)
        if slots % chunks:
            raise ValueError(f"{num_layers} layers + {slots - num_layers} accounted for (embedding/loss) = {slots} do not "
                             f"split into {chunks} pipeline chunks; change --num-layers or the pipeline sizes")  # fmt: skip
        sizes = [slots // chunks] * chunks
        sizes[0] -= int(account_for_embedding)
        sizes[-1] -= int(account_for_loss)
        starts = [sum(sizes[:i]) for i in range(chunks)]
        return [range(start, start + n) for start, n in zip(starts, sizes)]
    if pp == 1 and (first_stage_layers is not None or last_stage_layers is not None):
        raise ValueError("first/last stage layer counts need a pipeline of at least 2 stages")
    per_rank: list[int | None] = [None] * pp
    if first_stage_layers is not None:
        per_rank[0] = first_stage_layers
    if last_stage_layers is not None:
        per_rank[-1] = last_stage_layers
    fixed = sum(n for n in per_rank if n is not None)
    free = per_rank.count(None)
    rest = num_layers - fixed
    if rest < 0 or (free and rest % free) or (not free and rest):
        raise ValueError(f"cannot split {num_layers} layers over {pp} pipeline stages with first {first_stage_layers} "
                         f"and last {last_stage_layers}: the other {free} stages must share {rest} evenly")  # fmt: skip
    per_rank = [rest // free if n is None else n for n in per_rank]
    for rank, n in enumerate(per_rank):
        if n % virtual or (n == 0 and 0 < rank < pp - 1):
            raise ValueError(f"pipeline stage {rank} would hold {n} layers, which do not split into {virtual} virtual "
                             f"stages{' (a middle stage needs layers)' if n == 0 else ''}; change --num-layers, the "
                             f"pipeline size or the layers per virtual stage")  # fmt: skip
    ranges, start = [], 0
    for chunk in range(pp * virtual):
        n = per_rank[chunk % pp] // virtual
        ranges.append(range(start, start + n))
        start += n
    return ranges


# ---------------------------------------------------------------------- op order


def _check(kind: str, pp: int, pp_rank: int, num_micro_batches: int, virtual: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline schedule '{kind}': use one of {KINDS}")
    if not 0 <= pp_rank < pp or num_micro_batches < 1:
        raise ValueError(f"pipeline rank {pp_rank} of {pp} with {num_micro_batches} micro batches is not a schedule")
    if kind == "zbv":
        if pp < 2 or virtual != 2:
            raise ValueError(f"the zbv schedule runs two model chunks per rank in a V over at least 2 ranks, not {virtual} "
                             f"over {pp}; set --virtual-pipeline-model-parallel-size 2")  # fmt: skip
        return
    if kind != "interleaved" and virtual != 1:
        raise ValueError(f"schedule '{kind}' runs one model chunk per rank; virtual stages need 'interleaved' or 'zbv'")
    if kind == "interleaved":
        if pp == 1 and virtual > 1:
            raise ValueError("virtual pipeline stages need a pipeline of at least 2 stages")
        if num_micro_batches % pp:
            raise ValueError(f"the interleaved schedule needs the number of micro batches ({num_micro_batches}) to be "
                             f"a multiple of the pipeline size ({pp}), as in Megatron; change --global-batch-size "
                             f"or --micro-batch-size")  # fmt: skip


def schedule_order(kind: str, pp: int, pp_rank: int, num_micro_batches: int, virtual: int = 1) -> list[Op]:
    """The ops rank ``pp_rank`` runs, in order.

    ``afab``: every forward, then every backward (GPipe): simplest, activations of all micro batches
    alive at once. ``1f1b``: ``pp - rank - 1`` warm-up forwards, then one forward and one backward
    alternately, then the remaining backwards: at most ``pp - rank`` micro batches in flight.
    ``interleaved``: Megatron's 1F1B over ``virtual`` chunks per rank, micro batches taken in
    groups of ``pp`` per chunk; the bubble shrinks by ``virtual``.

    The zero-bubble schedules (Qi et al., 2023, "Zero Bubble Pipeline Parallelism") split each
    backward into ``B`` (the input gradient, which the previous stage waits for) and ``W`` (the
    weight gradients, which nobody waits for) and run the ``W`` where a rank would otherwise idle.
    ``zb-h1``: 1F1B's order with every ``B`` alone, each rank ``r`` holding back up to ``r`` of
    its ``W`` (so at most ``pp`` micro batches are in flight on any rank, 1F1B's peak on rank 0)
    and running them in the cool-down; bubble ``(pp - 1)(F + B - W)`` instead of 1F1B's
    ``(pp - 1)(F + B + W)``. ``zbv``: two chunks per rank in a V, the ZB-V order of the paper's
    section 6 (as torch.distributed.pipelining's ``ScheduleZBVZeroBubble``): ``2 (pp - rank) - 1``
    warm-up forwards of the first chunk, then forwards of both chunks, ``F B W`` triples of both
    in the steady state, and the ``W`` held back into the cool-down; at most ``2 pp`` chunk micro
    batches in flight (1F1B's ``pp`` of twice the size), bubble about ``pp - 1`` chunk forwards.
    """
    if kind in SPLIT_BACKWARD:
        _check(kind, pp, pp_rank, num_micro_batches, virtual)
        return _zb_h1_order(pp, pp_rank, num_micro_batches) if kind == "zb-h1" else _zbv_order(pp, pp_rank, num_micro_batches)
    return [op for unit in _units(kind, pp, pp_rank, num_micro_batches, virtual) for op in unit]


def forward_only_order(kind: str, pp: int, pp_rank: int, num_micro_batches: int, virtual: int = 1) -> list[Op]:
    """The forwards of ``kind``'s order alone (evaluation: no backward, nothing kept for one)."""
    return [op for op in schedule_order(kind, pp, pp_rank, num_micro_batches, virtual) if op[0] == "F"]


def _units(kind: str, pp: int, rank: int, m: int, v: int) -> list[list[Op]]:
    """The order cut where communication happens (see ``communication_plan``): after every op,
    except in the interleaved steady state, whose forward-backward pairs communicate together."""
    _check(kind, pp, rank, m, v)
    if kind == "afab":
        return [[("F", i, 0)] for i in range(m)] + [[("B", i, 0)] for i in range(m)]
    if kind == "1f1b":
        warmup = min(pp - rank - 1, m)
        order = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, 0), ("B", i, 0)]
        return [[op] for op in order + [("B", i, 0) for i in range(m - warmup, m)]]
    # Megatron-Core's forward_backward_pipelining_with_interleaving: virtual micro batch k
    # (0 .. m*v - 1) is micro batch (k // (pp*v)) * pp + k % pp, on chunk (k // pp) % v going
    # forward and v - 1 - (k // pp) % v going backward; all forwards first when m == pp.
    def mb(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    fwd = [("F", mb(k), (k // pp) % v) for k in range(m * v)]
    bwd = [("B", mb(k), v - 1 - (k // pp) % v) for k in range(m * v)]
    warmup = m * v if m == pp else min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)
    steady = len(fwd) - warmup
    return ([[op] for op in fwd[:warmup]] + [[fwd[warmup + k], bwd[k]] for k in range(steady)]
            + [[op] for op in bwd[steady:]])  # fmt: skip


def _zb_h1_order(pp: int, rank: int, m: int) -> list[Op]:
    """1F1B with the backward split: after each ``B`` the oldest pending ``W`` runs once more than
    ``rank`` are pending; the rest run at the end."""
    warmup = min(pp - rank - 1, m)
    order, pending = [("F", i, 0) for i in range(warmup)], []
    for i in range(m):
        if warmup + i < m:
            order.append(("F", warmup + i, 0))
        order.append(("B", i, 0))
        pending.append(i)
        if len(pending) > rank:
            order.append(("W", pending.pop(0), 0))
    return order + [("W", i, 0) for i in pending]


def _zbv_order(pp: int, rank: int, m: int) -> list[Op]:
    """The ZB-V order, written for ``max(m, 2 pp - 1)`` micro batches (enough to fill the V) and
    cut to the ``m`` there are. Local chunk 0 is the V's way down, 1 its way up."""
    n = max(m, 2 * pp - 1)
    order: list[Op] = []
    count = {(kind, v): 0 for kind in "FBW" for v in (0, 1)}

    def run(*ops: tuple[str, int]) -> None:
        for kind, v in ops:
            order.append((kind, count[kind, v], v))
            count[kind, v] += 1

    for _ in range(2 * (pp - rank) - 1):
        run(("F", 0))
    for _ in range(rank):
        run(("F", 1), ("F", 0))
    for _ in range(pp - rank):
        run(("F", 1), ("B", 1), ("W", 1))
    while count["F", 1] < count["F", 0] or count["F", 0] < n:
        if count["F", 0] < n:
            run(("F", 0))
        run(("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    for _ in range(rank):
        run(("B", 0), ("B", 1))
    for _ in range(pp - rank):
        run(("B", 0), ("W", 0))
    run(*[("W", 1)] * (count["B", 1] - count["W", 1]), *[("W", 0)] * (count["B", 0] - count["W", 0]))
    return [op for op in order if op[1] < m]


def bubble_fraction(kind: str, pp: int, num_micro_batches: int, virtual: int = 1) -> float:
    """Idle time over useful time in theory, equal forward/backward costs and free communication:
    ``(pp - 1) / m``, and ``(pp - 1) / (virtual * m)`` interleaved (Narayanan et al., 2021). The
    zero-bubble schedules' bubble depends on how the backward splits: for equal ``F``, ``B`` and
    ``W`` it is their order run on the clock (``modeled_bubble``), ``(pp - 1) / (3 m)`` for
    ``zb-h1`` and ``(pp - 1) / (6 m)`` for ``zbv`` once ``m`` fills the pipeline (``m >= pp``,
    ``m >= 2 pp - 1``)."""
    _check(kind, pp, 0, num_micro_batches, virtual)
    if kind in SPLIT_BACKWARD:
        return modeled_bubble(kind, pp, num_micro_batches, [1.0] * (pp * virtual))
    return (pp - 1) / (virtual * num_micro_batches)


# ---------------------------------------------------------------------- messages


def _producer(kind: str, op: Op, pp: int, rank: int, virtual: int) -> tuple[int, Op] | None:
    """The op whose output ``op`` takes as input: (its rank, it), or None for a first forward. A
    forward takes the previous chunk's forward, a backward the next chunk's backward (on the last
    chunk, its own forward: the loss), a ``W`` its own ``B``."""
    k, mb, v = op
    if k == "W":
        return rank, ("B", mb, v)
    chunk, last = model_chunk(kind, pp, rank, v), pp * virtual - 1
    if k == "F" and chunk == 0:
        return None
    if k == "B" and chunk == last:
        return rank, ("F", mb, v)
    other_rank, other_v = chunk_place(kind, pp, chunk - 1 if k == "F" else chunk + 1)
    return other_rank, (k, mb, other_v)


def _input_message(op: Op, pp: int, rank: int, virtual: int, kind: str = "1f1b") -> Message | None:
    """What ``op`` must receive first: a forward its input activation (unless it is the model's
    first chunk), a backward its output's gradient (unless the loss is computed right there); none
    when the producer is on this rank (the V's turn) or for a ``W``."""
    source = _producer(kind, op, pp, rank, virtual)
    if op[0] == "W" or source is None or source[0] == rank:
        return None
    peer, (k, mb, v) = source
    return Message(False, "act" if k == "F" else "grad", peer, mb, model_chunk(kind, pp, peer, v))


def p2p_links(kind: str, pp: int, virtual: int = 1) -> list[tuple[int, int]]:
    """Every (sender, receiver) pair of pipeline ranks that schedule ``kind`` may send a message
    over, whatever the number of micro batches: each boundary between consecutive model chunks
    on two ranks carries activations one way and gradients the other (``pipeline.connect_links``
    opens them all before the first step)."""
    links = set()
    for chunk in range(pp * virtual - 1):
        a, b = chunk_place(kind, pp, chunk)[0], chunk_place(kind, pp, chunk + 1)[0]
        if a != b:
            links |= {(a, b), (b, a)}
    return sorted(links)


def local_consumer(op: Op, pp: int, rank: int, virtual: int, kind: str = "1f1b") -> int | None:
    """The local chunk of this rank that takes ``op``'s output without a message (the V's turn:
    chunk pp - 1's activation to chunk pp, and its gradient back), or None."""
    k, _, v = op
    chunk = model_chunk(kind, pp, rank, v)
    target = chunk + 1 if k == "F" else chunk - 1
    if k == "W" or not 0 <= target < pp * virtual:
        return None
    target_rank, target_v = chunk_place(kind, pp, target)
    return target_v if target_rank == rank else None


def _output_message(op: Op, pp: int, rank: int, virtual: int, kind: str = "1f1b") -> Message | None:
    """What ``op`` hands on: a forward its output to the next chunk, a backward its input's gradient
    to the previous one (none past either end of the model, to this rank, or from a ``W``)."""
    k, mb, v = op
    chunk = model_chunk(kind, pp, rank, v)
    target = chunk + 1 if k == "F" else chunk - 1
    if k == "W" or not 0 <= target < pp * virtual or local_consumer(op, pp, rank, virtual, kind) is not None:
        return None
    return Message(True, "act" if k == "F" else "grad", chunk_place(kind, pp, target)[0], mb, chunk)


def communication_plan(kind: str, pp: int, pp_rank: int, num_micro_batches: int, virtual: int = 1,
                       forward_only: bool = False) -> list[Step]:  # fmt: skip
    """The steps rank ``pp_rank`` runs for ``schedule_order`` (or ``forward_only_order``).

    Before each op one batch carries the previous op's output and this op's input, so an
    activation leaves as soon as it exists (Megatron's 1F1B). Waiting on a batch whole is what
    NCCL's grouped calls amount to (a rank's later transfers queue behind its earlier ones), and
    under that rule per-op batches deadlock the interleaved schedule: there, as in Megatron, a
    steady-state forward and backward communicate together, the forward's output leaving after
    the backward and the backward's input fetched before the forward. The zero-bubble schedules
    run far ahead of their neighbours in places (the V's warm-up), where a send posted right away
    would wait for a receive posted much later: their sends are placed by ``_timed_plans``.

    Messages between two ranks (both neighbours are one rank when pp is 2) match in the order
    each side posts them: NCCL has no tags and gloo is given none, so both match the same way.
    ``tests/unit/test_pipeline_schedule.py`` runs every rank's plan together and checks that all
    complete and that every receive gets the message it expects.
    """
    if kind in SPLIT_BACKWARD:
        _check(kind, pp, pp_rank, num_micro_batches, virtual)
        return list(_timed_plans(kind, pp, num_micro_batches, virtual, forward_only)[pp_rank])
    units = _units(kind, pp, pp_rank, num_micro_batches, virtual)
    if forward_only:
        units = [[op] for unit in units for op in unit if op[0] == "F"]
    steps, sends = [], []
    for unit in units + [[]]:
        recvs = [_input_message(op, pp, pp_rank, virtual, kind) for op in unit]
        batch = sends + [msg for msg in recvs if msg is not None]
        if unit or batch:
            steps.append(Step(batch, unit))
        sends = [msg for msg in (_output_message(op, pp, pp_rank, virtual, kind) for op in unit) if msg is not None]
    return steps


@functools.lru_cache(maxsize=32)
def _timed_plans(kind: str, pp: int, m: int, virtual: int, forward_only: bool) -> tuple[tuple[Step, ...], ...]:
    """Every rank's steps for its order (one op a step, as in 1F1B), each send posted where its
    receiver asks for it: the orders are first run on an ideal clock (every op 1, a message
    arriving the moment it is sent), and a send goes into the last step its rank starts, on that
    clock, no later than the receiving op starts. On that clock nobody then waits for a send, and
    both ends of every channel post its messages in the receiver's order, so they match whatever
    the real costs: which message matches which, and whether the plans complete, does not depend
    on timing (``run_plans`` checks both). Cached: every training step asks again."""
    order_of = forward_only_order if forward_only else schedule_order
    orders = [order_of(kind, pp, r, m, virtual) for r in range(pp)]
    start, done, clock = {}, {}, [0.0] * pp
    boundaries: list[list[float]] = [[] for _ in range(pp)]  # when each rank posts each step
    position = [0] * pp
    while any(position[r] < len(orders[r]) for r in range(pp)):
        progress = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                op = orders[rank][position[rank]]
                source = _producer(kind, op, pp, rank, virtual)
                if source is not None and source not in done:
                    break
                boundaries[rank].append(clock[rank])
                start[(rank, op)] = max(clock[rank], done[source] if source is not None else 0.0)
                clock[rank] = done[(rank, op)] = start[(rank, op)] + 1.0
                position[rank] += 1
                progress = True
        if not progress:
            raise RuntimeError(f"schedule '{kind}': the orders wait on each other at ops {position}")
    for rank in range(pp):
        boundaries[rank].append(clock[rank])  # the trailing step, which only sends
    sends: list[list[list[tuple[float, Message]]]] = [[[] for _ in range(len(o) + 1)] for o in orders]
    index = [{op: i for i, op in enumerate(order)} for order in orders]
    for rank in range(pp):
        for op in orders[rank]:
            if _input_message(op, pp, rank, virtual, kind) is None:
                continue
            peer, produced = _producer(kind, op, pp, rank, virtual)
            when = start[(rank, op)]
            # the step after the producing op, or the last later one posted by ``when``
            step = max(index[peer][produced] + 1, bisect.bisect_right(boundaries[peer], when) - 1)
            sends[peer][step].append((when, _output_message(produced, pp, peer, virtual, kind)))
    plans = []
    for rank, order in enumerate(orders):
        steps = []
        for step, op in enumerate(order + [None]):
            batch = [msg for _, msg in sorted(sends[rank][step], key=lambda s: s[0])]
            recv = None if op is None else _input_message(op, pp, rank, virtual, kind)
            batch += [recv] if recv is not None else []
            if op is not None or batch:
                steps.append(Step(batch, [op] if op is not None else []))
        plans.append(tuple(steps))
    return tuple(plans)


# ---------------------------------------------------------------------- all ranks together


class Timeline(NamedTuple):
    """``run_plans``' account: the ops each rank ran in order, each rank's busy time, and when the
    last rank finished."""

    ops: list[list[Op]]
    busy: list[float]
    makespan: float


def run_plans(plans: list[list[Step]], op_cost: Callable[[int, Op], float] = lambda rank, op: 1.0) -> Timeline:
    """Run every rank's plan (rank ``r``'s is ``plans[r]``) together, as NCCL's grouped calls do:
    a rank posts a step's batch when it has run the previous step, runs the step's ops once every
    message of the batch has matched, and messages between two ranks match first-posted with
    first-posted (no tags). Communication is free: a message matches when both ends have posted.
    ``op_cost(rank, op)``: how long ``op`` takes on ``rank``.

    Raises ``RuntimeError`` on a deadlock or when a receive would get another message than the one
    it expects; what completes here also completes on gloo, whose sends are no stricter.
    """
    pp = len(plans)
    position, posted_at, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    open_msgs: list[dict[int, float]] = [{} for _ in range(pp)]  # unmatched -> inf; matched -> when
    queues: dict[tuple[int, int, bool], deque] = {}  # (sender, receiver, is the send side)
    ran: list[list[Op]] = [[] for _ in range(pp)]

    def post(rank: int) -> None:
        if position[rank] < len(plans[rank]):
            for i, msg in enumerate(plans[rank][position[rank]].batch):
                channel = (rank, msg.peer, True) if msg.send else (msg.peer, rank, False)
                queues.setdefault(channel, deque()).append((rank, i, msg))
                open_msgs[rank][i] = float("inf")

    for rank in range(pp):
        post(rank)
    while any(position[r] < len(plans[r]) for r in range(pp)):
        progress = False
        for (sender, receiver, is_send), sends in queues.items():
            recvs = queues.get((sender, receiver, False), deque()) if is_send else deque()
            while sends and recvs:
                (s_rank, s_i, sent), (r_rank, r_i, wanted) = sends.popleft(), recvs.popleft()
                if (sent.kind, sent.mb, sent.chunk) != (wanted.kind, wanted.mb, wanted.chunk):
                    raise RuntimeError(f"rank {r_rank} expected {wanted} from rank {s_rank} but got {sent}")
                matched = max(posted_at[s_rank], posted_at[r_rank])
                open_msgs[s_rank][s_i] = open_msgs[r_rank][r_i] = matched
                progress = True
        for rank in range(pp):
            while position[rank] < len(plans[rank]) and all(t < float("inf") for t in open_msgs[rank].values()):
                clock = max([posted_at[rank], *open_msgs[rank].values()])
                for op in plans[rank][position[rank]].ops:
                    cost = op_cost(rank, op)
                    clock, busy[rank] = clock + cost, busy[rank] + cost
                ran[rank] += plans[rank][position[rank]].ops
                position[rank], posted_at[rank], open_msgs[rank] = position[rank] + 1, clock, {}
                post(rank)
                progress = True
        if not progress:
            raise RuntimeError(f"deadlock: ranks stuck at steps {position} of {[len(p) for p in plans]}")
    if any(queues.values()):
        raise RuntimeError("unmatched messages left over")
    return Timeline(ran, busy, max(posted_at))


@functools.lru_cache(maxsize=64)
def _all_plans(kind: str, pp: int, m: int, virtual: int) -> tuple[tuple[Step, ...], ...]:
    """Every rank's ``communication_plan``, cached: the split's refinement and ``meshtron plan``
    run the same schedule on the clock under many chunk costs."""
    return tuple(tuple(communication_plan(kind, pp, r, m, virtual)) for r in range(pp))


def modeled_bubble(kind: str, pp: int, num_micro_batches: int, chunk_costs: list[float]) -> float:
    """The bubble of ``kind`` run on the clock when model chunk ``c`` costs ``chunk_costs[c]`` per
    micro batch (a third forward, two thirds backward, communication free; a split backward a
    third input gradient and a third weight gradient): the step's time over the perfectly split
    work (all chunks' cost over ``pp``), minus one. Equal chunk costs give ``bubble_fraction``;
    unequal ones show what an unbalanced split costs."""
    virtual = len(chunk_costs) // pp
    plans = _all_plans(kind, pp, num_micro_batches, virtual)
    backward = 1 / 3 if kind in SPLIT_BACKWARD else 2 / 3

    def cost(rank: int, op: Op) -> float:
        share = backward if op[0] == "B" else 1 / 3
        return share * chunk_costs[model_chunk(kind, pp, rank, op[2])]

    ideal = num_micro_batches * sum(chunk_costs) / pp
    return run_plans(plans, cost).makespan / ideal - 1 if ideal > 0 else 0.0
