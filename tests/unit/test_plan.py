"""``meshtron plan``: the enumeration against a brute-force list, the memory pruning against
``estimate``, the step-time model's directions, and the printed commands against the config's
own parsing and validation."""

import dataclasses
import itertools
import json
import shlex

import pytest
import torch

from meshtron.cli import main
from meshtron.config import build_config
from meshtron.estimate import estimate, training_vocab_size
from meshtron.planning.hardware import SHIPPED, Machine, interpolate, load
from meshtron.planning.layouts import SHARDINGS, Layout, Space, apply, candidates, refusal
from meshtron.planning.report import train_command
from meshtron.planning.search import GIB, check, search
from meshtron.models import spec_for
from meshtron.planning.step_time import StepModel
from meshtron.validation import validate

D = "distributed-optimizer"


def _cfg(*flags: str):
    cfg = build_config(None, ["--mock-data", *flags])
    cfg.model.vocab_size = training_vocab_size(cfg)
    return cfg


TINY_DENSE = ("--model.preset", "tiny-llama", "--num-layers", "4", "--global-batch-size", "8")
TINY_MOE = ("--model.preset", "tiny-mixtral", "--num-layers", "2", "--global-batch-size", "4")


def _brute_force(cfg, world: int, space: Space) -> set[Layout]:
    """Every combination of sizes 1..world (micro batch 1..global batch, every sharding) that the
    space's rules allow and ``validate`` accepts; the space's rules, restated: sizes within its
    bounds, tp x pp x cp x dp = world, dp x cp > 1 shards state (distributed optimizer, or FSDP2
    when tp = pp = 1), dp x cp = 1 shards none."""
    out = set()
    sizes = range(1, world + 1)
    for tp, pp, vp, cp, ep, etp in itertools.product(sizes, sizes, range(1, space.max_virtual + 1), sizes, sizes, sizes):
        if world % (tp * pp * cp) or tp > space.max_tp or cp > space.max_cp or pp > space.max_pp or etp > space.max_tp or (pp == 1 and vp > 1):
            continue
        dp = world // (tp * pp * cp)
        for mbs, sharding in itertools.product(range(1, min(space.max_micro_batch, cfg.train.global_batch_size) + 1), SHARDINGS):
            if (sharding == "none") != (dp * cp == 1) or (sharding == "fsdp" and not (space.fsdp and tp == pp == 1)):
                continue
            layout = Layout(tp, pp, vp, cp, ep, etp, dp, sharding, mbs)
            if refusal(cfg, layout) is None:
                out.add(layout)
    return out


@pytest.mark.parametrize("flags", [TINY_DENSE, TINY_MOE], ids=["dense", "moe"])
def test_enumeration_is_complete(flags):
    """On 4 GPUs the candidates that validation accepts are exactly the brute-force list, and
    every candidate the enumeration skips is one validation refuses too."""
    cfg = _cfg(*flags)
    space = Space(max_tp=4, max_cp=4, max_virtual=3, recomputes=("",), bf16_moments=(False,))
    enumerated = {layout for layout in candidates(cfg, 4, space) if refusal(cfg, layout) is None}
    assert enumerated and enumerated == _brute_force(cfg, 4, space)
    if cfg.model.num_experts:
        assert any(layout.ep > 1 for layout in enumerated) and any(layout.etp > 1 for layout in enumerated)


def test_options_expand_every_layout():
    """Recompute, bf16 moments and FP8 multiply the layouts, FSDP2 keeping fp32 moments."""
    cfg = _cfg(*TINY_DENSE)
    plain = set(candidates(cfg, 2, Space(recomputes=("",), bf16_moments=(False,))))
    full = list(candidates(cfg, 2, Space(fp8=(False, True))))
    fsdp = sum(1 for layout in plain if layout.sharding == "fsdp")
    assert len(full) == (len(plain) * 3 * 2 - fsdp * 3) * 2
    assert not any(layout.sharding == "fsdp" and layout.bf16_moments for layout in full)


def _small_machine(gib: float) -> Machine:
    return dataclasses.replace(load("h100"), memory_gib=gib, memory_usable=1.0)


def test_memory_pruning_equals_estimate():
    """Every checked layout's bytes are ``estimate``'s for that layout, and a layout is pruned
    exactly when they exceed the usable memory."""
    cfg = _cfg("--model.preset", "tiny-llama", "--num-layers", "4", "--global-batch-size", "8", "--seq-length", "256",
               "--max-position-embeddings", "256")  # fmt: skip
    layouts = [layout for layout in candidates(cfg, 2, Space(bf16_moments=(False,))) if refusal(cfg, layout) is None]
    needs = {layout: estimate(apply(cfg, layout), layout.world).total_bytes for layout in layouts}
    limit = sorted(needs.values())[len(needs) // 2] / GIB  # half of them fit
    machine = _small_machine(limit)
    pruned = 0
    for layout in layouts:
        status, need, _ = check(cfg, layout, machine)
        assert need == needs[layout]
        assert status == ("memory" if need > limit * GIB else "fits")
        pruned += status == "memory"
    assert 0 < pruned < len(layouts)
    result = search(cfg, 2, 2, machine, Space(bf16_moments=(False,)), top=3)
    assert all(v.memory_bytes == needs[v.layout] <= limit * GIB for v in result.fits)
    assert all(v.memory_bytes == needs[v.layout] > limit * GIB for v in result.others if v.status == "memory")


LLAMA8B = ("--model.preset", "llama3-8b", "--num-layers", "8", "--seq-length", "8192", "--global-batch-size", "8")


def test_more_pipeline_stages_more_bubble():
    """At 8 micro batches, pp 2, 4, 8 (one rank per stage) idle more, on both splits."""
    cfg = _cfg(*LLAMA8B)
    model = StepModel(cfg, load("h100"), 8)
    for exact in (False, True):
        bubbles = [model.predict(Layout(1, pp, 1, 1, 1, 1, 1, "none", 1), exact_split=exact).bubble for pp in (2, 4, 8)]
        assert 0 < bubbles[0] < bubbles[1] < bubbles[2]
    one = model.predict(Layout(1, 4, 1, 1, 1, 1, 1, "none", 1))
    two = model.predict(Layout(1, 4, 2, 1, 1, 1, 1, "none", 1))
    assert two.bubble < one.bubble  # interleaving shrinks it


def test_more_tensor_parallelism_more_communication():
    cfg = _cfg(*LLAMA8B)
    model = StepModel(cfg, load("h100"), 8)
    shares = [model.predict(Layout(tp, 1, 1, 1, 1, 1, 8 // tp, D, 1)).share(("tp comm",)) for tp in (1, 2, 4, 8)]
    assert shares[0] == 0 < shares[1] < shares[2] < shares[3]


def test_recompute_costs_compute_and_saves_memory():
    cfg = _cfg(*LLAMA8B)
    model = StepModel(cfg, load("h100"), 8)
    steps, memory = [], []
    for recompute in ("", "selective", "full"):
        layout = Layout(1, 1, 1, 1, 1, 1, 8, D, 1, recompute)
        prediction = model.predict(layout)
        steps.append(prediction.step_s)
        memory.append(estimate(apply(cfg, layout), 8).total_bytes)
        assert (prediction.parts["recompute"] > 0) == bool(recompute)
    assert steps[0] < steps[1] < steps[2] and memory[0] > memory[1] > memory[2]


@pytest.mark.parametrize("flags", [TINY_DENSE, TINY_MOE], ids=["dense", "moe"])
def test_refused_layouts_are_never_proposed_and_commands_validate(flags):
    """Every proposed layout passes validation, and its printed command parses back to that layout
    and validates at its world size. With every layout checked (a large ``top``), the dense
    model's interleaved layouts with fewer micro batches than stages were refused, not proposed."""
    cfg = _cfg(*flags)
    base = ["--mock-data", *flags]
    result = search(cfg, 4, 4, load("h100"), Space(max_virtual=3, recomputes=("",), bf16_moments=(False,)), top=10_000)
    assert result.fits and not any(v.status == "unchecked" for v in result.others)
    if not cfg.model.num_experts:
        assert any(v.status == "refused" and "interleaved schedule" in v.why for v in result.others)
    assert all(refusal(cfg, v.layout) for v in result.others if v.status == "refused")
    for v in result.fits:
        assert refusal(cfg, v.layout) is None
        words = shlex.split(train_command(base, v))
        flags = words[words.index("train") + 1:]
        parsed = build_config(None, flags)
        validate(parsed, world_size=v.layout.world)
        assert dataclasses.asdict(parsed.parallel) == dataclasses.asdict(apply(cfg, v.layout).parallel)
        assert parsed.train.micro_batch_size == v.layout.micro_batch


def test_plan_command(capsys):
    assert main(["plan", "--gpus", "2", "--top", "2", "--mock-data", *TINY_DENSE]) == 0
    out = capsys.readouterr().out
    assert "torchrun --nproc-per-node 2 -m meshtron train" in out and "why the others lost" in out
    assert main(["plan", "--gpus", "2", "--tp", "2", *TINY_DENSE]) == 2
    assert "the planner chooses the layout" in capsys.readouterr().err
    assert main(["plan", *TINY_DENSE]) == 2  # no --gpus


def test_shipped_machines_name_their_sources():
    for name in SHIPPED:
        machine = load(name)
        numbers = [f.name for f in dataclasses.fields(Machine) if f.name not in ("device", "on_paper", "sources")]
        assert set(numbers) <= set(machine.sources), f"{name}: say where {set(numbers) - set(machine.sources)} come from"
    assert load("mi300x").on_paper and not load("h100").on_paper


def test_calibration_file_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(load("h200").to_json())
    assert load(str(path)) == load("h200")
    raw = json.loads(path.read_text())
    del raw["hbm_gbps"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="missing fields \\['hbm_gbps'\\]"):
        load(str(path))


def test_interpolate_is_log_linear_and_clamped():
    points = [[1e6, 10.0], [1e8, 30.0]]
    assert interpolate(points, 1.0) == 10.0 and interpolate(points, 1e9) == 30.0
    assert interpolate(points, 1e7) == pytest.approx(20.0)


def test_calibrated_gemm_curve_is_made_non_decreasing():
    from meshtron.planning.calibrate import monotone

    points = [[1e9, 100.0], [2e9, 400.0], [3e9, 200.0], [4e9, 600.0], [5e9, 500.0], [6e9, 700.0]]
    assert monotone(points) == [[1e9, 100.0], [2e9, 300.0], [3e9, 300.0], [4e9, 550.0], [5e9, 550.0], [6e9, 700.0]]
    assert monotone(points[:1]) == points[:1]


def test_failed_measurement_names_the_rank_error_not_the_launcher_summary():
    from meshtron.planning.measure import failure_lines

    log = "iteration 1\n[rank0]: torch.OutOfMemoryError: CUDA out of memory.\ntorch.distributed.elastic...ChildFailedError:\n  x"
    assert failure_lines(log) == "[rank0]: torch.OutOfMemoryError: CUDA out of memory.\n  x"
    assert failure_lines("a\nb\nc\nd") == "b\nc\nd"  # no error line: the log's end


def test_a_run_past_its_time_is_stopped_and_said_so():
    """``run_until`` gives a run's exit code and output, and stops one that runs past its time
    (SIGTERM, which torchrun passes to its ranks) with None for the code."""
    import sys
    import time

    from meshtron.planning.measure import run_until

    assert run_until([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], 60) == (3, "hi\n")
    began = time.time()
    code, out = run_until([sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"], 2)
    assert code is None and out == "started\n" and time.time() - began < 30


@pytest.mark.slow  # two trainer launches: ~80 s on 2 busy cores; the GPU proof is benchmarks/plan_check.py
def test_measure_runs_the_printed_layout_through_the_trainer():
    """``--measure``'s runner trains a layout with the planner's flags (one CPU process here) and
    reads its tokens/s off the trainer's log; a refused flag comes back as a failure, not a number."""
    from meshtron.planning.measure import run_layout

    base = ["--device", "cpu", "--model.preset", "tiny-llama", "--global-batch-size", "4", "--seq-length", "32"]
    got = run_layout(base, Layout(1, 1, 1, 1, 1, 1, 1, "none", 2), steps=4, timeout_s=300)
    assert got.tokens_per_s_gpu > 0 and not got.error
    bad = run_layout(base, Layout(1, 1, 1, 1, 1, 1, 1, "none", 3), steps=4, timeout_s=300)  # 3 does not divide 4
    assert bad.tokens_per_s_gpu == 0 and "global-batch-size" in bad.error


def test_host_time_per_block_is_the_step_difference_over_added_blocks(monkeypatch):
    """``--calibrate``'s host time per block kind: a stand-in trainer whose forward + backward
    lasts 10 ms per dense block, 30 ms per MoE block and 15 ms besides gives back 10 and 30 (the
    model cut to one MoE block, then four more of each kind); under full recompute, cut models that
    recompute, timed alike. The optimizer step is never timed: it is the GPU's HBM traffic, once a
    step, which the step model prices apart. Sleeps long against a loaded machine's wake-up delays."""
    import time

    import meshtron.training.trainer as trainer_module
    from meshtron.planning.calibrate import host_ms_per_block

    built = []

    class Stepping:
        def __init__(self, cfg, log):
            pattern = json.loads(cfg.model.moe_layer_freq)
            assert len(pattern) == cfg.model.num_layers and cfg.train.global_batch_size == cfg.train.micro_batch_size == 1
            built.append((pattern, cfg.model.recompute_granularity))
            self.seconds = (0.015 + sum(0.030 if moe else 0.010 for moe in pattern)) * (2 if cfg.model.recompute_granularity else 1)

        def accumulate_gradients(self):
            time.sleep(self.seconds)

        def train_step(self):
            raise AssertionError("the optimizer step is not part of the host's launches per block")

    monkeypatch.setattr(trainer_module, "Trainer", Stepping)
    cfg = _cfg(*TINY_MOE, "--moe-layer-freq", "[0,1]")
    measured = host_ms_per_block(cfg)
    patterns = [[1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]  # one block, then SLOPE_BLOCKS more of each kind
    assert built == [(p, "") for p in patterns]
    assert (cfg.model.num_layers, cfg.model.moe_layer_freq, cfg.data.seq_length) == (2, "[0,1]", _cfg(*TINY_MOE).data.seq_length)
    assert measured["dense"] == pytest.approx(10.0, abs=2.0) and measured["moe"] == pytest.approx(30.0, abs=2.0)
    built.clear()
    recomputed = host_ms_per_block(cfg, "full")
    assert built == [(p, "full") for p in patterns]
    assert recomputed["dense"] == pytest.approx(20.0, abs=3.0) and recomputed["moe"] == pytest.approx(60.0, abs=3.0)


def test_measured_recompute_host_times_replace_the_fitted_factor(tmp_path):
    """Under full recompute a block's host time is the calibration's measured one where the file
    has it (per kind), else the plain time times ``host_factors["recompute"]``; files written
    before the field load without it."""
    machine = dataclasses.replace(load("h200"), host_ms_per_block={"dense": 4.0, "moe": 6.0}, host_factors={"recompute": 1.5},
                                  host_ms_per_block_recompute={"moe": 11.0})  # fmt: skip
    assert machine.host_ms("moe", True) == 11.0 and machine.host_ms("moe", False) == 6.0
    assert machine.host_ms("dense", True) == pytest.approx(6.0) and machine.host_ms("dense", False) == 4.0
    model = StepModel(_cfg(*TINY_MOE), machine, 2)
    assert model._host_seconds(Layout(1, 1, 1, 1, 1, 1, 2, D, 1, "full"), "moe") == pytest.approx(0.011)
    raw = json.loads(machine.to_json())
    del raw["host_ms_per_block_recompute"]
    (tmp_path / "cal.json").write_text(json.dumps(raw))
    assert load(str(tmp_path / "cal.json")).host_ms_per_block_recompute == {}


def test_host_calibration_adds_one_block_where_more_do_not_fit(monkeypatch):
    import time

    import meshtron.training.trainer as trainer_module
    from meshtron.planning.calibrate import host_ms_per_block

    built = []

    class Stepping:  # a GPU that holds two blocks, not five
        def __init__(self, cfg, log):
            pattern = json.loads(cfg.model.moe_layer_freq)
            built.append(pattern)
            if len(pattern) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory")
            self.seconds = 0.015 + sum(0.030 if moe else 0.010 for moe in pattern)

        def accumulate_gradients(self):
            time.sleep(self.seconds)

    monkeypatch.setattr(trainer_module, "Trainer", Stepping)
    measured = host_ms_per_block(_cfg(*TINY_MOE, "--moe-layer-freq", "[0,1]"))
    assert built == [[1], [1, 0, 0, 0, 0], [1, 0], [1, 1, 1, 1, 1], [1, 1]]
    assert measured["dense"] == pytest.approx(10.0, abs=3.0) and measured["moe"] == pytest.approx(30.0, abs=3.0)

    class NoRoom(Stepping):  # a GPU that holds one block, not two
        def __init__(self, cfg, log):
            if cfg.model.num_layers > 1:
                raise torch.OutOfMemoryError("CUDA out of memory")
            super().__init__(cfg, log)

    monkeypatch.setattr(trainer_module, "Trainer", NoRoom)
    with pytest.raises(torch.OutOfMemoryError, match="cut to 2 blocks does not fit this GPU"):
        host_ms_per_block(_cfg(*TINY_MOE, "--moe-layer-freq", "[0,1]"))


def test_a_block_takes_at_least_the_hosts_time():
    """Below the host's time per block the step waits for it (``host wait``), more so with the
    layout features that add host work; above it the GPU's parts decide alone."""
    cfg = _cfg(*TINY_MOE)
    machine = dataclasses.replace(load("h200"), host_ms_per_block={"dense": 1.0, "moe": 50.0}, host_factors={"ep": 2.0})
    model = StepModel(cfg, machine, 4)
    one, ep2 = model.predict(Layout(1, 1, 1, 1, 1, 1, 2, D, 1)), model.predict(Layout(1, 1, 1, 1, 2, 1, 2, D, 1))
    blocks = cfg.model.num_layers * cfg.train.global_batch_size // 2  # micro batches of one sample on each of 2 ranks
    gpu = sum(v for k, v in one.parts.items() if k in ("gemm", "attention", "elementwise", "ep comm"))
    assert one.parts["host wait"] == pytest.approx(blocks * 0.050 - gpu, rel=1e-3)  # the sum has the output layer's tiny parts too
    assert ep2.parts["host wait"] > 1.9 * one.parts["host wait"]
    fast = StepModel(cfg, dataclasses.replace(machine, host_ms_per_block={}), 4).predict(Layout(1, 1, 1, 1, 1, 1, 2, D, 1))
    assert fast.parts["host wait"] == 0 and fast.step_s < one.step_s
    # a chunk that waits for the host has its launches in that wait, not again as per-chunk overhead
    assert one.parts["overhead"] == pytest.approx(machine.step_overhead_ms / 1e3)
    assert fast.parts["overhead"] > one.parts["overhead"]


def test_host_and_gpu_times_combine_by_the_overlap_power():
    """A block takes (host^p + GPU^p)^(1/p): at p = 1 the host's time adds to the GPU's whole, at a
    large p only its excess counts (the larger of the two), and the shipped 4 lies between."""
    cfg, layout = _cfg(*TINY_MOE), Layout(1, 1, 1, 1, 1, 1, 2, D, 1)
    base = dataclasses.replace(load("h200"), host_ms_per_block={"dense": 0.2, "moe": 0.2}, host_ms_per_block_recompute={})

    def block(power: float) -> tuple[float, float, float]:
        """(host wait, GPU parts, host time) of the first block under ``power``."""
        model = StepModel(cfg, dataclasses.replace(base, host_overlap_power=power), 2)
        applied = apply(cfg, layout)
        first = model._block(applied, layout, spec_for(cfg.model).block_shapes(applied)[0], model.shapes(1, 1, 1).blocks[0])
        wait = first.parts["host wait"]
        return wait, first.total - wait, model._host_seconds(layout, "moe")

    added, gpu, host = block(1.0)
    assert added == pytest.approx(host)
    assert block(1e6)[0] == pytest.approx(max(0.0, host - gpu), abs=1e-9)
    shipped = block(load("h200").host_overlap_power)[0]
    assert shipped == pytest.approx((host**4 + gpu**4) ** 0.25 - gpu) and block(1e6)[0] < shipped < added


def test_grouped_gemms_run_at_the_factor_of_their_rows_per_expert():
    """Where the calibration measured the grouped GEMMs by rows per expert, the step model reads
    the factor at the layout's rows (log-interpolated), so a larger micro batch's experts run
    nearer dense speed; without the curve every size takes ``grouped_gemm_factor``."""
    flat = dataclasses.replace(load("h200"), grouped_gemm_factor=0.5, grouped_gemm_curve=[], host_ms_per_block={})
    curved = dataclasses.replace(flat, grouped_gemm_curve=[[100.0, 0.5], [10000.0, 1.0]])
    assert flat.grouped_factor(5000) == 0.5
    assert curved.grouped_factor(50) == 0.5 and curved.grouped_factor(1000) == pytest.approx(0.75) and curved.grouped_factor(1e6) == 1.0
    cfg = _cfg(*TINY_MOE, "--seq-length", "4096")
    small, large = Layout(1, 1, 1, 1, 1, 1, 2, D, 1), Layout(1, 1, 1, 1, 1, 1, 1, "none", 4)
    saved = []
    for layout in (small, large):
        rows = 4096 * layout.micro_batch * cfg.model.moe_router_topk / cfg.model.num_experts
        assert curved.grouped_factor(rows) > 0.5
        flat_gemm, curved_gemm = (StepModel(cfg, mc, 2).predict(layout).parts["gemm"] for mc in (flat, curved))
        saved.append(1 - curved_gemm / flat_gemm)
    assert 0 < saved[0] < saved[1]  # four times the rows per expert: nearer dense speed, more saved


def test_layout_features_add_their_host_work():
    """Each feature adds its factor less one of the block's host time; they add, not compound,
    and full recompute's measured time is the base the collectives add to. FSDP2 adds the same
    under recompute: the rerun forward does not gather again or rerun its hooks' work."""
    machine = dataclasses.replace(load("h200"), host_ms_per_block={"moe": 10.0}, host_ms_per_block_recompute={"moe": 18.0},
                                  host_factors={"tp": 1.5, "ep": 1.25, "fsdp": 2.0, "cp": 1.5})  # fmt: skip
    model = StepModel(_cfg(*TINY_MOE), machine, 8)
    assert model._host_seconds(Layout(1, 1, 1, 1, 2, 1, 2, "fsdp", 1), "moe") == pytest.approx(0.010 * (1 + 0.25 + 1.0))
    assert model._host_seconds(Layout(2, 1, 1, 2, 2, 1, 2, D, 1, "full"), "moe") == pytest.approx(0.018 * (1 + 0.5 + 0.5 + 0.25))
    assert model._host_seconds(Layout(1, 1, 1, 1, 2, 1, 2, "fsdp", 1, "full"), "moe") == pytest.approx(0.018 * (1 + 0.25) + 0.010 * 1.0)


def test_calibration_files_from_before_the_host_model_take_the_shipped_host_times(tmp_path):
    path = tmp_path / "cal.json"
    raw = json.loads(load("h200").to_json())
    del raw["host_ms_per_block"], raw["host_factors"], raw["sustained_share"], raw["synced_host_shares"]
    path.write_text(json.dumps(raw))
    assert load(str(path)).host_ms_per_block == load("h200").host_ms_per_block
    assert load(str(path)).sustained_share == load("h200").sustained_share
    assert load(str(path)).synced_host_shares == load("h200").synced_host_shares
    raw.update(host_ms_per_block={"dense": 9.0}, host_factors={"ep": 9.0}, sustained_share=0.1)  # a file written before a refit
    path.write_text(json.dumps(raw))
    refitted = load(str(path))
    assert refitted.host_ms_per_block == {"dense": 9.0}  # measured: the file's
    assert refitted.host_factors == load("h200").host_factors and refitted.sustained_share == load("h200").sustained_share  # fitted: shipped


def test_the_sustained_share_scales_the_calibrated_rates():
    """A step sustains ``sustained_share`` of the GEMM and attention rates the calibration timed
    kernel by kernel: the rates scale by it, and a GPU-bound layout's GEMM time by its inverse."""
    cfg, shipped = _cfg(*TINY_MOE), load("h200")
    full = dataclasses.replace(shipped, sustained_share=1.0, host_ms_per_block={})
    slower = dataclasses.replace(full, sustained_share=0.5)
    assert slower.gemm_rate(1e12) == pytest.approx(0.5 * full.gemm_rate(1e12))
    assert slower.attention_rate(4096) == pytest.approx(0.5 * full.attention_rate(4096))
    layout = Layout(1, 1, 1, 1, 1, 1, 2, D, 1)
    a, b = StepModel(cfg, full, 4).predict(layout), StepModel(cfg, slower, 4).predict(layout)
    assert b.parts["gemm"] == pytest.approx(2 * a.parts["gemm"]) and b.parts["attention"] == pytest.approx(2 * a.parts["attention"])


def test_host_work_after_the_expert_dispatchs_sync_is_not_hidden():
    """Under ep or etp the dispatch reads its split sizes back once per MoE block, so FSDP2's and
    etp's host work after it (``synced_host_shares`` of the MoE block's host time) adds to the
    block's time even where the GPU's parts exceed the host's; without ep and etp, or in a dense
    model, nothing is added."""
    shares = {"fsdp": 0.5, "etp": 0.25}
    machine = dataclasses.replace(load("h200"), host_ms_per_block={"dense": 1e-3, "moe": 1e-3}, synced_host_shares=shares)
    cfg = _cfg(*TINY_MOE)  # 2 MoE blocks, global batch 4
    model = StepModel(cfg, machine, 4)

    def synced(ep: int, etp: int, sharding: str, dp: int = 4, mbs: int = 1) -> float:
        return model.predict(Layout(1, 1, 1, 1, ep, etp, dp, sharding, mbs)).parts["host sync"]

    per_block = machine.host_ms_per_block["moe"] / 1e3
    blocks = 2 * cfg.train.global_batch_size // 4  # MoE blocks x micro batches of one sample on each of 4 ranks
    assert synced(1, 2, "fsdp") == pytest.approx(blocks * per_block * 0.75)
    assert synced(2, 1, "fsdp") == pytest.approx(blocks * per_block * 0.5)
    assert synced(1, 2, D) == pytest.approx(blocks * per_block * 0.25)
    assert synced(2, 1, D) == synced(1, 1, "fsdp") == synced(1, 1, D) == 0.0
    etp_fsdp = Layout(1, 1, 1, 1, 1, 2, 4, "fsdp", 1)
    hidden = StepModel(cfg, dataclasses.replace(machine, synced_host_shares={}), 4).predict(etp_fsdp)
    assert hidden.parts["host sync"] == 0 and hidden.parts["host wait"] < 1e-4 * hidden.step_s  # the GPU's parts far exceed the host's
    assert model.predict(etp_fsdp).step_s == pytest.approx(hidden.step_s + blocks * per_block * 0.75, abs=1e-6)
    dense = StepModel(_cfg(*TINY_DENSE), machine, 4).predict(Layout(1, 1, 1, 1, 1, 1, 4, "fsdp", 1))
    assert dense.parts["host sync"] == 0


def test_a_host_bound_pipeline_launches_through_its_bubble():
    """A rank waiting for its peer's activation keeps launching (the receive is a stream wait),
    so where the host bounds every chunk the step is the busiest rank's load, not the schedule's
    clock with its bubble on top; under ep the dispatch's host sync holds the host back, so the
    bubble stays; a GPU-bound pipeline keeps its bubble."""
    # 4 MoE blocks, 2 a stage (a small vocabulary keeps the output layer from taking a stage), 4 micro batches a rank
    cfg = _cfg("--model.preset", "tiny-mixtral", "--num-layers", "4", "--global-batch-size", "8", "--vocab-size", "512")
    host_bound = dataclasses.replace(load("h200"), host_ms_per_block={"dense": 50.0, "moe": 50.0}, host_factors={})
    model = StepModel(cfg, host_bound, 4)
    free = model.predict(Layout(1, 2, 1, 1, 1, 1, 2, D, 1), exact_split=True)
    synced = model.predict(Layout(1, 2, 1, 1, 2, 1, 2, D, 1), exact_split=True)
    assert free.parts["host wait"] > 0.9 * free.step_s - 0.01 and free.bubble < 0.01
    assert synced.bubble == pytest.approx(0.25, abs=0.01)  # 1F1B's (pp - 1) / micro batches
    assert free.step_s < 0.9 * synced.step_s
    gpu_bound = StepModel(cfg, dataclasses.replace(host_bound, host_ms_per_block={}), 4)
    assert gpu_bound.predict(Layout(1, 2, 1, 1, 1, 1, 2, D, 1), exact_split=True).bubble > 0.2


def test_context_parallel_host_work_grows_with_each_ring_step():
    """Each ring step beyond the first adds the same host work (an exchange, a block kernel call
    and a merge forward, two exchanges backward), so the host time per block grows linearly in
    cp - 1, ``host_factors["cp"]`` being the factor at cp 2."""
    machine = dataclasses.replace(load("h200"), host_ms_per_block={"dense": 10.0}, host_ms_per_block_recompute={},
                                  host_factors={"cp": 1.5, "recompute": 2.0})  # fmt: skip
    model = StepModel(_cfg(*TINY_DENSE), machine, 8)
    host = {cp: model._host_seconds(Layout(1, 1, 1, cp, 1, 1, 8 // cp, D, 1), "dense") for cp in (1, 2, 4, 8)}
    assert host[1] == pytest.approx(0.010) and host[2] == pytest.approx(0.015)
    assert host[4] == pytest.approx(0.025) and host[8] == pytest.approx(0.045)
    recomputed = model._host_seconds(Layout(1, 1, 1, 4, 1, 1, 2, D, 1, "full"), "dense")
    assert recomputed == pytest.approx(2 * host[4])  # the rerun forward repeats its ring steps too


def test_fsdp_traffic_hides_in_the_gpus_host_waits():
    """FSDP2's gathers and reduce-scatters run on their own stream: where the GPU waits for the
    host, they take that idle time, so a host-bound layout exposes none of them, while a
    GPU-bound one exposes the share ``fsdp_overlap`` does not hide."""
    cfg, fsdp = _cfg(*LLAMA8B), Layout(1, 1, 1, 1, 1, 1, 8, "fsdp", 1)
    gpu_bound = StepModel(cfg, dataclasses.replace(load("h200"), host_ms_per_block={}), 8).predict(fsdp)
    host_bound = StepModel(cfg, dataclasses.replace(load("h200"), host_ms_per_block={"dense": 500.0}), 8).predict(fsdp)
    assert gpu_bound.parts["host wait"] == 0 and gpu_bound.parts["dp comm"] > 0
    assert host_bound.parts["host wait"] > gpu_bound.parts["dp comm"] and host_bound.parts["dp comm"] == 0


def test_ring_attention_adds_its_own_elementwise_traffic():
    """Besides its block kernels, ring attention casts, merges and accumulates in fp32 and repeats
    grouped keys and values at every step: a cp layout moves more bytes per token over HBM than
    dp over the same ranks, more so at a larger cp."""
    cfg, machine = _cfg(*LLAMA8B), dataclasses.replace(load("h200"), host_ms_per_block={})
    model = StepModel(cfg, machine, 8)
    dp, cp2, cp4 = (model.predict(Layout(1, 1, 1, cp, 1, 1, 4 // cp, D, 1)).parts["elementwise"] for cp in (1, 2, 4))
    assert dp < cp2 < cp4
    per_token = [model._ring_elementwise_seconds(cfg.model, Layout(1, 1, 1, cp, 1, 1, 4 // cp, D, 1), 1.0) for cp in (2, 4)]
    assert per_token[1] > per_token[0] > 0


def test_a_host_bound_layout_is_flagged_in_the_report():
    """A layout whose GPU waits for the host a third of its step or more gets a line saying its
    prediction is the least certain; a compute-bound one does not."""
    from meshtron.planning.report import table
    from meshtron.planning.search import PlanResult, Verdict
    from meshtron.planning.step_time import Prediction

    layout = Layout(1, 1, 1, 1, 1, 1, 1, "none", 1)
    bound = Prediction(1.0, 1000.0, 0.1, 0.0, {"gemm": 0.5, "host wait": 0.3, "host sync": 0.05})
    free = Prediction(1.0, 1000.0, 0.1, 0.0, {"gemm": 0.7, "host wait": 0.3})
    assert bound.host_bound and not free.host_bound
    text = table(PlanResult([Verdict(layout, bound, "fits"), Verdict(layout, free, "fits")], [], 2, 1.0), ["--model.preset", "tiny-llama"])
    flagged = [line for line in text.splitlines() if line.strip().startswith("host-bound")]
    assert len(flagged) == 1 and "35% of the step" in flagged[0]


def test_the_decoupled_rate_prices_the_reference_optimizer_step():
    """--decoupled-lr runs the reference AdamW step: the clip's read and write of each gradient and
    the copy into the bf16 parameter (14 bytes a parameter) beside the fused step's 30; bf16
    moments, which need the fused step, are never proposed beside it."""
    layout = Layout(1, 1, 1, 1, 1, 1, 1, "none", 2)
    plain = StepModel(_cfg(*TINY_DENSE), load("h100"), 1).predict(layout).parts["optimizer"]
    cfg = _cfg(*TINY_DENSE, "--decoupled-lr", "1e-3")
    decoupled = StepModel(cfg, load("h100"), 1).predict(layout).parts["optimizer"]
    assert decoupled / plain == pytest.approx((30 + 14 + 8) / (30 + 8))  # 8: the buffer's zeroing and the norm's read
    assert refusal(cfg, dataclasses.replace(layout, bf16_moments=True)) is not None
