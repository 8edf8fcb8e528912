"""The zero-bubble schedules without processes: their orders (every F, B and W once, in a valid
order, within their memory), every rank's plan run together (no deadlock, every receive the
message it expects), their bubble on the clock against the paper's formulas and 1F1B's, the V
placement in the split and the estimate, the refusals in validation, and the weight-gradient
store itself (B leaves the linears' weight gradients to W, which lands them exactly). The runs on
processes, against one process, are ``tests/distributed/test_pipeline_zero_bubble.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshtron.config import ConfigError, ParallelConfig, build_config
from meshtron.estimate import first_stage_blocks
from meshtron.kernels.deferred_wgrad import WeightGradStore
from meshtron.kernels.grad_accum_fusion import apply_gradient_accumulation_fusion
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.parallel.pipeline_balance import PipelineCosts, describe_split, pipeline_split
from meshtron.parallel.pipeline_schedules import (
    bubble_fraction,
    chunk_place,
    communication_plan,
    forward_only_order,
    model_chunk,
    modeled_bubble,
    run_plans,
    schedule_order,
)
from meshtron.validation import validate

ZB_CASES = [("zb-h1", pp, m, 1) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]
ZB_CASES += [("zbv", pp, m, 2) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 7, 8, 16)]


def plans_for(kind: str, pp: int, m: int, v: int, forward_only: bool = False) -> list[list]:
    return [communication_plan(kind, pp, r, m, v, forward_only) for r in range(pp)]


def in_flight_peak(order: list) -> int:
    """Most micro batches (of a chunk) whose forward ran and whose weight gradient has not."""
    alive, peak = 0, 0
    for kind, _, _ in order:
        alive += {"F": 1, "B": 0, "W": -1}[kind]
        peak = max(peak, alive)
    return peak


@pytest.mark.parametrize("kind,pp,m,v", ZB_CASES)
def test_every_op_once_in_order_within_memory_and_no_deadlock(kind, pp, m, v):
    for rank in range(pp):
        order = schedule_order(kind, pp, rank, m, v)
        expected = {(k, mb, c) for k in "FBW" for mb in range(m) for c in range(v)}
        assert len(order) == len(expected) and set(order) == expected
        position = {op: i for i, op in enumerate(order)}
        for k, mb, c in order:
            if k != "F":
                assert position[("F" if k == "B" else "B", mb, c)] < position[(k, mb, c)]
        for c in range(v):  # each chunk takes its micro batches in order, forward and backward
            for k in "FBW":
                assert [mb for kk, mb, cc in order if (kk, cc) == (k, c)] == list(range(m))
        # zb-h1: pp in flight at most (1F1B's peak, on rank 0); zbv: 2 pp chunk micro batches
        assert in_flight_peak(order) <= pp * v
    plans = plans_for(kind, pp, m, v)
    for rank, plan in enumerate(plans):  # no message to oneself: the V's turn is handed over locally
        assert all(msg.peer != rank for step in plan for msg in step.batch)
        assert all(len(step.ops) <= 1 for step in plan)
    assert run_plans(plans).ops == [schedule_order(kind, pp, r, m, v) for r in range(pp)]
    assert run_plans(plans_for(kind, pp, m, v, True)).ops == [forward_only_order(kind, pp, r, m, v) for r in range(pp)]


def test_zb_h1_is_1f1b_with_the_weight_gradients_held_back_by_rank():
    """pp 4, 8 micro batches: rank 0 runs each W right after its B; rank r holds back r of them
    (the last rank 3, which has no warm-up to fill its start), all run by the end."""
    F, B, W = "F", "B", "W"
    assert schedule_order("zb-h1", 4, 3, 8)[:12] == [(F, 0, 0), (B, 0, 0), (F, 1, 0), (B, 1, 0), (F, 2, 0), (B, 2, 0),
                                                     (F, 3, 0), (B, 3, 0), (W, 0, 0), (F, 4, 0), (B, 4, 0), (W, 1, 0)]  # fmt: skip
    assert schedule_order("zb-h1", 4, 3, 8)[-4:] == [(W, 4, 0), (W, 5, 0), (W, 6, 0), (W, 7, 0)]
    rank0 = schedule_order("zb-h1", 4, 0, 8)
    assert rank0[:9] == [(F, 0, 0), (F, 1, 0), (F, 2, 0), (F, 3, 0), (B, 0, 0), (W, 0, 0), (F, 4, 0), (B, 1, 0), (W, 1, 0)]
    for rank in range(4):
        order = schedule_order("zb-h1", 4, rank, 8)
        assert [op for op in order if op[0] != "W"] == schedule_order("1f1b", 4, rank, 8)
        held = max(sum(1 for k, _, _ in order[: i + 1] if k == "B") - sum(1 for k, _, _ in order[: i + 1] if k == "W")
                   for i in range(len(order)))  # fmt: skip
        assert held == rank + 1  # r held back, plus the one whose W comes next


def test_zbv_places_chunks_in_a_v():
    assert [model_chunk("zbv", 4, r, v) for r in range(4) for v in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert [chunk_place("zbv", 4, c) for c in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    assert [chunk_place("interleaved", 4, c) for c in (0, 5)] == [(0, 0), (1, 1)]
    # rank 0's warm-up: 2 pp - 1 forwards down the V, then its first chunk of the way up
    assert schedule_order("zbv", 4, 0, 8, 2)[:8] == [("F", i, 0) for i in range(7)] + [("F", 0, 1)]
    # the turn (rank pp - 1) receives chunk pp's input from itself: no message carries it
    plan = communication_plan("zbv", 4, 3, 8, 2)
    assert not any(msg.chunk == 3 and msg.kind == "act" for step in plan for msg in step.batch)


def test_bubble_on_the_clock_against_the_paper():
    """Equal F, B and W (each a third of a chunk's micro batch), free communication. 1F1B's idle
    share of the step at pp 4, 8 micro batches is 3/11; ZB-H1's is (p - 1)(F + B - W) over the
    step, 3 / 27 = 1/9; ZB-V's about pp - 1 chunk forwards, 3 / 51."""
    one = run_plans(plans_for("1f1b", 4, 8, 1), lambda rank, op: 1.0 if op[0] == "F" else 2.0)
    zb = run_plans(plans_for("zb-h1", 4, 8, 1), lambda rank, op: 1.0)
    zbv = run_plans(plans_for("zbv", 4, 8, 2), lambda rank, op: 0.5)  # a chunk is half a stage
    idle = {name: 1 - t.busy[0] / t.makespan for name, t in (("1f1b", one), ("zb-h1", zb), ("zbv", zbv))}
    assert idle["1f1b"] == pytest.approx(3 / 11)
    assert idle["zb-h1"] == pytest.approx((4 - 1) * (1 + 1 - 1) / (8 * 3 + (4 - 1) * (1 + 1 - 1))) == pytest.approx(1 / 9)
    assert idle["zbv"] == pytest.approx(1.5 / 25.5) and idle["zbv"] < idle["zb-h1"] < idle["1f1b"]
    assert all(b == t.busy[0] for t in (one, zb, zbv) for b in t.busy)
    # unequal parts: the formula holds while W is no longer than F and B
    f, b, w = 1.0, 1.2, 0.8
    timed = run_plans(plans_for("zb-h1", 4, 8, 1), lambda rank, op: {"F": f, "B": b, "W": w}[op[0]])
    assert timed.makespan == pytest.approx(8 * (f + b + w) + 3 * (f + b - w))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16), (3, 9)])
def test_bubble_fraction_closed_forms(pp, m):
    """Idle over useful time for equal F, B, W: (pp - 1) / (3 m) for zb-h1 once m >= pp, and
    (pp - 1) / (6 m) for zbv once m >= 2 pp - 1; both below 1F1B's (pp - 1) / m and interleaved's
    (pp - 1) / (2 m); the clock of ``modeled_bubble`` with equal chunks gives the same."""
    assert bubble_fraction("zb-h1", pp, m) == pytest.approx((pp - 1) / (3 * m))
    assert modeled_bubble("zb-h1", pp, m, [1.0] * pp) == pytest.approx((pp - 1) / (3 * m))
    if m >= 2 * pp - 1:
        assert bubble_fraction("zbv", pp, m, 2) == pytest.approx((pp - 1) / (6 * m))
    assert bubble_fraction("zbv", pp, m, 2) < bubble_fraction("zb-h1", pp, m) < bubble_fraction("1f1b", pp, m)


def test_schedule_errors_say_what_to_change():
    with pytest.raises(ValueError, match="virtual-pipeline-model-parallel-size 2"):
        schedule_order("zbv", 4, 0, 8, 1)
    with pytest.raises(ValueError, match="'interleaved' or 'zbv'"):
        schedule_order("zb-h1", 4, 0, 8, 2)


def test_split_and_estimate_follow_the_v():
    """Under zbv rank 0 holds the first and the last chunk: the per-rank costs of the split and
    the estimate's first-stage blocks count chunks 0 and 2 pp - 1 together."""
    costs = PipelineCosts(0.0, [1.0] * 8, 2.0)
    zbv = ParallelConfig(pipeline_parallel=2, virtual_pipeline_parallel=2, pipeline_schedule="zbv")
    split = pipeline_split(zbv, 8, 2, costs, "zbv", 8)
    chunk = costs.chunk_costs(split)
    assert sum(len(r) for r in split) == 8 and chunk[0] + chunk[3] == chunk[1] + chunk[2]
    line = describe_split(split, costs, "zbv", 2, 8)
    assert f"per rank [{chunk[0] + chunk[3]:.2f}, {chunk[1] + chunk[2]:.2f}]" in line
    cfg = build_config(None, ["--mock-data", "--pp", "2", "--pipeline-schedule", "zbv", "--virtual-pipeline-model-parallel-size",
                              "2", "--num-layers", "8", "--global-batch-size", "16", "--pipeline-split", "uniform"])  # fmt: skip
    validate(cfg, world_size=2)
    assert first_stage_blocks(cfg, 8, 2) == [0, 1, 6, 7]


def _validate(*flags: str, world_size: int = 2) -> None:
    validate(build_config(None, ["--mock-data", "--pp", "2", "--num-layers", "8", "--micro-batch-size", "2",
                                 "--global-batch-size", "16", *flags]), world_size=world_size)  # fmt: skip


def test_validation_accepts_and_refuses_with_the_flag_to_change():
    _validate("--pipeline-schedule", "zb-h1")
    _validate("--pipeline-schedule", "zbv", "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "6")  # m 3: any
    _validate("--pipeline-schedule", "zb-h1", "--recompute-granularity", "full")
    refusals = [
        (["--pipeline-schedule", "zbv"], "--virtual-pipeline-model-parallel-size 2"),
        (["--pipeline-schedule", "zb-h1", "--virtual-pipeline-model-parallel-size", "2"], "zb-h1 runs one model chunk per rank"),
        (["--pipeline-schedule", "zb-h1", "--compile"], "drop --compile"),
        (["--pipeline-schedule", "zbv", "--virtual-pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"],
         "--account-for-embedding/loss-in-pipeline-split"),
        (["--pipeline-schedule", "zb"], "--pipeline-schedule must be auto, afab, 1f1b, interleaved, zb-h1, zbv"),
    ]
    for flags, message in refusals:
        with pytest.raises(ConfigError, match=message):
            _validate(*flags)


def test_validation_refuses_fp8_with_a_zero_bubble_schedule():
    cfg = build_config(None, ["--mock-data", "--pp", "2", "--num-layers", "8", "--global-batch-size", "16",
                              "--pipeline-schedule", "zb-h1", "--fp8-format", "hybrid", "--device", "cuda"])  # fmt: skip
    with pytest.raises(ConfigError, match="drop --fp8-format or use --pipeline-schedule 1f1b"):
        validate(cfg, world_size=2)


# ---------------------------------------------------------------------- the store


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.LayerNorm(20), nn.Linear(20, 6, bias=False)).to(dtype)
    apply_gradient_accumulation_fusion(model)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w_lands_what_b_left_exactly(dtype):
    """Three micro batches, each B recorded then its W later (the last two in reverse order): the
    linears' weight gradients stay untouched by B and land in W; the buffer ends equal to three
    plain backward passes (fp32 exactly; bf16 as close as the fused path's own rounding)."""
    xs = [torch.randn(4, 12, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(3)]
    plain_model = _model(dtype)
    plain = GradBuffer(list(plain_model.named_parameters()))  # the fused path, weight gradients in backward
    for x in xs:
        plain_model(x).float().square().sum().backward()
    model = _model(dtype)
    split = GradBuffer(list(model.named_parameters()))
    store = WeightGradStore()
    for i, x in enumerate(xs):
        with store.record((i, 0)):
            model(x).float().square().sum().backward()
    weights = {n: p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2}
    assert len(store.pending) == 3 and all(len(v) == 2 for v in store.pending.values())
    assert all(p in split._unwritten for p in weights.values()) if dtype != torch.float32 else True
    if dtype == torch.float32:
        assert all(p.main_grad.abs().sum() == 0 for p in weights.values())  # B left them alone
    assert model[1].weight.main_grad.abs().sum() > 0  # the norm's gradient came with B
    for key in [(0, 0), (2, 0), (1, 0)]:
        store.run(key)
    store.check_empty()
    split.finish_grad_sync()
    plain.finish_grad_sync()
    torch.testing.assert_close(split.data, plain.data, rtol=1e-6, atol=1e-5)


def test_store_refuses_nesting_and_a_missing_w():
    model = _model(torch.float32)
    GradBuffer(list(model.named_parameters()))
    store = WeightGradStore()
    with store.record((0, 0)):
        with pytest.raises(RuntimeError, match="already recording"):
            with store.record((1, 0)):
                pass
        model(torch.ones(2, 12)).sum().backward()
    with pytest.raises(RuntimeError, match=r"\[\(0, 0\)\] were deferred but never run"):
        store.check_empty()
