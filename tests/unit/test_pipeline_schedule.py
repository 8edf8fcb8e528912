"""Pipeline schedules as pure data: op orders written out by hand, every op once and in a valid
order, and every rank's communication plan run together to prove it neither deadlocks nor hands a
receive the wrong message.

The simulation (``run_plans``) is the strict model of NCCL's grouped point-to-point calls: a rank
posts a step's batch, may not run the step's op (nor post later batches) until every message of
the batch has matched, and messages between two ranks match first-posted with first-posted (no
tags). Anything that completes here also completes on gloo, whose sends are no stricter. Run on
the clock with equal costs, the schedules give their theoretical bubble.
"""

from __future__ import annotations

import pytest

from meshtron.parallel.pipeline_schedules import (
    Message,
    Step,
    _input_message,
    _output_message,
    bubble_fraction,
    communication_plan,
    forward_only_order,
    modeled_bubble,
    p2p_links,
    run_plans,
    schedule_order,
    split_layers,
)
from tests.distributed.nccl_links import mismatched_first_contacts


def simulate(plans: list[list]) -> list[list]:
    """Run every rank's plan together; return the ops each rank ran, in the order it ran them.
    Fails on a deadlock or on a receive matched with a message other than the one it expects."""
    return run_plans(plans).ops


def plans_for(kind: str, pp: int, m: int, v: int, forward_only: bool = False) -> list[list]:
    return [communication_plan(kind, pp, r, m, v, forward_only) for r in range(pp)]


def per_op_plan(order: list, pp: int, rank: int, v: int) -> list[Step]:
    """A plan for any ``order``: before each op, one batch with the previous op's output and this
    op's input (what ``communication_plan`` does outside the interleaved steady state)."""
    plan, sends = [], []
    for op in order + [None]:
        recv = None if op is None else _input_message(op, pp, rank, v)
        plan.append(Step(sends + [recv] * (recv is not None), [op] if op else []))
        out = None if op is None else _output_message(op, pp, rank, v)
        sends = [out] * (out is not None)
    return plan


def test_1f1b_pp4_m8_by_hand():
    """Warm-up of pp - rank - 1 forwards, then F/B pairs, then the remaining backwards."""
    expected_warmup = {0: 3, 1: 2, 2: 1, 3: 0}
    for rank, warmup in expected_warmup.items():
        order = schedule_order("1f1b", 4, rank, 8)
        expected = [("F", i, 0) for i in range(warmup)]
        expected += [op for i in range(8 - warmup) for op in (("F", warmup + i, 0), ("B", i, 0))]
        expected += [("B", i, 0) for i in range(8 - warmup, 8)]
        assert order == expected
    assert schedule_order("1f1b", 4, 0, 8)[:6] == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("B", 0, 0),
                                                   ("F", 4, 0)]  # fmt: skip
    assert schedule_order("1f1b", 4, 3, 8)[:4] == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
    # Each activation leaves right after its forward, not after the next backward.
    assert all(len(step.ops) <= 1 for rank in range(4) for step in communication_plan("1f1b", 4, rank, 8))


def test_interleaved_pp2_v2_m4_matches_megatron_by_hand():
    """Megatron-Core's interleaved order, worked by hand for pp 2, 2 chunks, 4 micro batches.

    Forward virtual micro batches k = 0..7 run (mb, chunk) = (0,0) (1,0) (0,1) (1,1) (2,0) (3,0)
    (2,1) (3,1); backward ones (0,1) (1,1) (0,0) (1,0) (2,1) (3,1) (2,0) (3,0). Warm-up is
    (pp - rank - 1) * 2 + (v - 1) * pp: 4 forwards on rank 0, 2 on rank 1; then forward k+warmup
    and backward k alternate; then the rest of the backwards.
    """
    F, B = "F", "B"
    rank0 = [(F, 0, 0), (F, 1, 0), (F, 0, 1), (F, 1, 1),
             (F, 2, 0), (B, 0, 1), (F, 3, 0), (B, 1, 1), (F, 2, 1), (B, 0, 0), (F, 3, 1), (B, 1, 0),
             (B, 2, 1), (B, 3, 1), (B, 2, 0), (B, 3, 0)]  # fmt: skip
    rank1 = [(F, 0, 0), (F, 1, 0),
             (F, 0, 1), (B, 0, 1), (F, 1, 1), (B, 1, 1), (F, 2, 0), (B, 0, 0), (F, 3, 0), (B, 1, 0),
             (F, 2, 1), (B, 2, 1), (F, 3, 1), (B, 3, 1),
             (B, 2, 0), (B, 3, 0)]  # fmt: skip
    assert schedule_order("interleaved", 2, 0, 4, 2) == rank0
    assert schedule_order("interleaved", 2, 1, 4, 2) == rank1


def test_interleaved_with_as_many_micro_batches_as_stages_is_all_forward_first():
    order = schedule_order("interleaved", 4, 2, 4, 2)
    assert [k for k, _, _ in order] == ["F"] * 8 + ["B"] * 8


CASES = [("afab", pp, m, 1) for pp in (1, 2, 4) for m in (1, 3, 8)]
CASES += [("1f1b", pp, m, 1) for pp in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]
CASES += [("interleaved", pp, m, v) for pp in (2, 3, 4) for v in (1, 2, 3) for m in (pp, 2 * pp, 4 * pp)]


@pytest.mark.parametrize("kind,pp,m,v", CASES)
def test_every_op_once_backward_after_forward_and_no_deadlock(kind, pp, m, v):
    for rank in range(pp):
        order = schedule_order(kind, pp, rank, m, v)
        expected = {(k, mb, c) for k in "FB" for mb in range(m) for c in range(v)}
        assert len(order) == len(expected) and set(order) == expected
        for op in order:
            if op[0] == "B":
                assert order.index(("F", op[1], op[2])) < order.index(op)
    ran = simulate(plans_for(kind, pp, m, v))
    assert ran == [schedule_order(kind, pp, r, m, v) for r in range(pp)]
    ran = simulate(plans_for(kind, pp, m, v, forward_only=True))
    assert ran == [forward_only_order(kind, pp, r, m, v) for r in range(pp)]


def test_1f1b_keeps_at_most_pp_minus_rank_micro_batches_in_flight():
    for rank in range(4):
        in_flight, peak = 0, 0
        for kind, _, _ in schedule_order("1f1b", 4, rank, 8):
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == 4 - rank


def test_simulator_catches_deadlock_and_mismatch():
    """The checker can fail: per-op batches (the previous op's output with the next op's input)
    deadlock the interleaved schedule, and micro batches taken in another order on one rank
    arrive as the wrong message."""
    per_op = [per_op_plan(schedule_order("interleaved", 2, rank, 4, 2), 2, rank, 2) for rank in range(2)]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(per_op)
    plans = plans_for("1f1b", 2, 2, 1)
    plans[1] = [Step([Message(False, "act", 0, 1, 0)], [("F", 1, 0), ("B", 1, 0)]),
                Step([Message(True, "grad", 0, 1, 1), Message(False, "act", 0, 0, 0)], [("F", 0, 0), ("B", 0, 0)]),
                Step([Message(True, "grad", 0, 0, 1)], [])]  # fmt: skip
    with pytest.raises(RuntimeError, match="expected"):
        simulate(plans)


def test_errors_say_what_to_change():
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        schedule_order("interleaved", 4, 0, 6, 2)
    with pytest.raises(ValueError, match="interleaved"):
        schedule_order("1f1b", 2, 0, 4, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule_order("zb", 2, 0, 4)


def test_split_layers_accounting_for_embedding_and_loss():
    # 7 layers + the loss = 8 slots over pp 2 x 2 virtual: the last chunk holds one real layer
    assert split_layers(7, 2, 2, account_for_loss=True) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    # 6 layers + embedding + loss = 8 slots over pp 2: 4 per stage, one of them not a layer
    assert split_layers(6, 2, account_for_embedding=True, account_for_loss=True) == [range(0, 3), range(3, 6)]
    assert split_layers(10, 2, 2, account_for_embedding=True, account_for_loss=True) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    with pytest.raises(ValueError, match="do not split into 4 pipeline chunks"):
        split_layers(8, 2, 2, account_for_loss=True)
    with pytest.raises(ValueError, match="does not combine"):
        split_layers(8, 2, account_for_loss=True, first_stage_layers=3)


def test_split_layers():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    # interleaved: model chunk k = v * pp + rank, contiguous in model order
    assert split_layers(4, 2, 2) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert split_layers(8, 4, 1, first_stage_layers=1, last_stage_layers=1) == [
        range(0, 1), range(1, 4), range(4, 7), range(7, 8)]  # fmt: skip
    assert split_layers(8, 2, 2, first_stage_layers=2) == [range(0, 1), range(1, 4), range(4, 5), range(5, 8)]
    assert split_layers(6, 3, 1, first_stage_layers=0, last_stage_layers=0) == [range(0, 0), range(0, 6), range(6, 6)]
    with pytest.raises(ValueError, match="share"):
        split_layers(5, 2)
    with pytest.raises(ValueError, match="virtual"):
        split_layers(6, 2, 2)
    with pytest.raises(ValueError, match="middle stage"):
        split_layers(4, 3, 1, first_stage_layers=2, last_stage_layers=2)


def test_bubble_fraction():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("afab", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction("1f1b", 1, 8) == 0.0


@pytest.mark.parametrize("kind,pp,m,v", [c for c in CASES if c[1] > 1])
def test_equal_costs_on_the_clock_give_the_theoretical_bubble(kind, pp, m, v):
    """Each rank's own step list, every forward 1 and backward 2 (and, separately, both 1): the
    idle share of the step is (pp - 1) / (v m + pp - 1), i.e. the bubble over useful time is
    ``bubble_fraction``. A schedule that ran a backward late, or a warm-up one forward short,
    would idle longer here."""
    for backward in (1.0, 2.0):
        timeline = run_plans(plans_for(kind, pp, m, v), lambda rank, op: 1.0 if op[0] == "F" else backward)
        assert timeline.busy == [m * v * (1 + backward)] * pp
        idle = 1 - timeline.busy[0] / timeline.makespan
        assert idle == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)
    assert modeled_bubble(kind, pp, m, [1.0] * (pp * v)) == pytest.approx(bubble_fraction(kind, pp, m, v), abs=1e-12)


def test_the_clock_sees_a_short_warm_up_and_an_unbalanced_split():
    """The check can fail: 1F1B whose rank 0 skips its warm-up forward (the last rank's order)
    idles more than theory, and an uneven chunk (the last one carrying an output layer worth two
    layers, the even split of 8 Llama-3-8B layers) adds bubble."""
    plans = plans_for("1f1b", 2, 8, 1)
    plans[0] = per_op_plan(schedule_order("1f1b", 2, 1, 8), 2, 0, 1)
    timeline = run_plans(plans, lambda rank, op: 1.0)
    assert 1 - timeline.busy[0] / timeline.makespan > 1 / 9 + 0.1
    assert run_plans(plans_for("1f1b", 2, 8, 1), lambda rank, op: 1.0).makespan == 18
    assert modeled_bubble("interleaved", 2, 8, [2, 2, 2, 4.09]) > 0.25 > bubble_fraction("interleaved", 2, 8, 2)


LINK_CASES = CASES + [("zb-h1", pp, m, 1) for pp in (2, 3, 4) for m in (1, 2, 3, 5)]
LINK_CASES += [("zbv", pp, m, 2) for pp in (2, 3, 4) for m in (1, 2, 3, 5, 8)]


def _calls(plans: list[list[Step]], links: list[tuple[int, int]] | None) -> list[list]:
    """Every rank's ``batch_isend_irecv`` calls (``nccl_links.Call``, pipeline ranks as global
    ranks): the set-up's over ``links`` first when given, then each step's batch."""
    group = tuple(range(len(plans)))
    calls = [[] for _ in plans]
    for rank, plan in enumerate(plans):
        if links is not None:
            calls[rank].append([(a == rank, b if a == rank else a, group) for a, b in links if rank in (a, b)])
        calls[rank] += [[(m.send, m.peer, group) for m in step.batch] for step in plan if step.batch]
    return calls


@pytest.mark.parametrize("kind,pp,m,v", [c for c in LINK_CASES if c[1] > 1])
def test_every_message_travels_a_link_opened_before_the_first_step(kind, pp, m, v):
    """Every transfer of every plan, training or evaluation, goes over a link ``connect_links``
    opens at set-up in one mirrored call: NCCL never connects a pair inside a schedule."""
    links = set(p2p_links(kind, pp, v))
    for forward_only in (False, True):
        plans = plans_for(kind, pp, m, v, forward_only)
        messages = [(r, msg) for r, plan in enumerate(plans) for step in plan for msg in step.batch]
        used = {(r, msg.peer) if msg.send else (msg.peer, r) for r, msg in messages}
        assert used <= links
        assert mismatched_first_contacts(_calls(plans, sorted(links))) == []
    assert {r for link in links for r in link} == set(range(pp))  # every rank takes part in the set-up


def test_the_schedules_alone_would_connect_unmirrored_with_one_micro_batch():
    """Why the set-up connects: with one micro batch, 1F1B's rank 0 first sends and receives in
    one call while rank 1 receives, then sends in another (so the zero-bubble schedules too); with
    two micro batches 1F1B's first contacts happen to mirror."""
    assert mismatched_first_contacts(_calls(plans_for("1f1b", 2, 1, 1), None)) == [
        "ranks 0 and 1 (group [0, 1]) first connect [['recv', 'send']] in rank 0's calls "
        "but the mirror of [['send'], ['recv']] in rank 1's"]  # fmt: skip
    assert mismatched_first_contacts(_calls(plans_for("1f1b", 4, 1, 1), None))
    assert mismatched_first_contacts(_calls(plans_for("zbv", 2, 1, 2), None))
    assert mismatched_first_contacts(_calls(plans_for("1f1b", 2, 2, 1), None)) == []
