"""NCCL's rule for the first transfer between two ranks, checked on the transfers gloo ran.

NCCL connects a pair of ranks lazily, at the first group call that sends or receives between
them, by a handshake inside that call (``ncclTransportP2pSetup``, src/transport.cc): each rank
exchanges its new send and receive connectors with the peer, and assumes the peer's call connects
the mirrored directions. On a two-rank group both directions go in one message whose length each
side expects to be its own ("Message truncated": ncclInternalError); on more ranks a side waits
for a direction the peer connects only in a later call, and the peer waits in its own call's
closing handshake: both hang. Gloo has no such handshake, so the CPU tests run fine either way;
recording every ``batch_isend_irecv`` a rank posts and checking this rule is how they see it.

The rule checked: between every two ranks of a group, the calls in which each first sends to or
receives from the other pair up in order, each connecting the mirror of the other's directions.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch.distributed as dist

Call = list[tuple[bool, int, tuple[int, ...]]]  # per transfer: (is a send, peer's global rank, group's ranks)


@contextlib.contextmanager
def recorded_p2p() -> Iterator[list[Call]]:
    """Every ``dist.batch_isend_irecv`` call made inside, in order, as ``Call`` lists."""
    calls: list[Call] = []
    original = dist.batch_isend_irecv

    def recording(ops):
        calls.append([(op.op is dist.isend, op.peer, tuple(dist.get_process_group_ranks(op.group))) for op in ops])
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        yield calls
    finally:
        dist.batch_isend_irecv = original


def first_contacts(rank: int, calls: list[Call]) -> dict[tuple[tuple[int, ...], int], list[frozenset[str]]]:
    """Per (group, peer): the directions ("send", "recv") each call of ``rank`` connects first, in call order."""
    connected: set[tuple[tuple[int, ...], int, str]] = set()
    out: dict[tuple[tuple[int, ...], int], list[frozenset[str]]] = defaultdict(list)
    for call in calls:
        new: dict[tuple[tuple[int, ...], int], set[str]] = defaultdict(set)
        for is_send, peer, group in call:
            direction = "send" if is_send else "recv"
            if peer != rank and (group, peer, direction) not in connected:
                new[(group, peer)].add(direction)
        for (group, peer), directions in new.items():
            connected |= {(group, peer, d) for d in directions}
            out[(group, peer)].append(frozenset(directions))
    return out


def mismatched_first_contacts(calls_by_rank: list[list[Call]]) -> list[str]:
    """Where the ranks' calls (``calls_by_rank[r]``: global rank r's) break the rule above; empty
    when NCCL connects every pair cleanly."""
    mirror = {"send": "recv", "recv": "send"}
    contacts = [first_contacts(rank, calls) for rank, calls in enumerate(calls_by_rank)]
    pairs = {(min(rank, peer), max(rank, peer), group) for rank, mine in enumerate(contacts) for group, peer in mine}
    problems = []
    for a, b, group in sorted(pairs):
        ours = contacts[a].get((group, b), [])
        theirs = [frozenset(mirror[d] for d in directions) for directions in contacts[b].get((group, a), [])]
        if ours != theirs:
            problems.append(f"ranks {a} and {b} (group {list(group)}) first connect {[sorted(c) for c in ours]} in rank {a}'s "
                            f"calls but the mirror of {[sorted(c) for c in theirs]} in rank {b}'s")  # fmt: skip
    return problems
