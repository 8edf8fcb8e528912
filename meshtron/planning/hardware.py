"""What the step-time model knows about a machine: the rates it divides work by, read from a JSON
file that ``meshtron plan --calibrate`` writes on the machine itself, or from the shipped defaults
(``defaults/h100.json``, ``h200.json``, ``mi300x.json``), each number with its source in the file.

Rates are curves of (size, rate) points, read by linear interpolation in log(size) and clamped at
the ends: a GEMM's TFLOP/s by its FLOPs, attention's by the query tokens of one rank, a
collective's bus bandwidth (NCCL's convention: bytes x (g - 1) / g over time) by the bytes of the
whole tensor. A group that spans nodes runs at the network's rate per GPU (``inter_node_gbps``,
which the command line can override), capped by the NVLink curve.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

DEFAULTS = Path(__file__).parent / "defaults"
SHIPPED = {"h100": "h100.json", "h200": "h200.json", "mi300x": "mi300x.json"}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")
HOST_FEATURES = ("tp", "cp", "ep", "etp", "fsdp", "recompute")  # what adds host work to a block (host_factors)
ADDED_FIELDS = ("host_ms_per_block",)  # measured, missing from older calibration files: the shipped machine's
# The step model's constants, fitted on measured grids (not measured by --calibrate, which copies
# them): a calibration file always takes the shipped machine's, so a refit reaches files written before it
FITTED_FIELDS = ("host_factors", "sustained_share", "synced_host_shares", "fsdp_overlap", "host_overlap_power")
OPTIONAL_FIELDS = ("on_paper", "sources", "host_ms_per_block_recompute", "grouped_gemm_curve")  # a file may leave out


def interpolate(points: list[list[float]], x: float) -> float:
    """The rate at size ``x`` on the curve ``points`` ([size, rate], sizes increasing), linear in
    log(size), flat beyond the ends."""
    sizes = [p[0] for p in points]
    if x <= sizes[0]:
        return points[0][1]
    if x >= sizes[-1]:
        return points[-1][1]
    i = bisect.bisect_right(sizes, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + f * (y1 - y0)


@dataclass
class Machine:
    """One GPU kind's rates (see the module docstring; ``sources`` says where each came from)."""

    device: str
    peak_tflops: float  # dense bf16 datasheet peak: MFU's denominator (training/peak_flops.py)
    memory_gib: float  # what torch reports as the GPU's memory
    memory_usable: float  # share of it a run may plan for (allocator, CUDA context, NCCL buffers take the rest)
    hbm_gbps: float  # achieved HBM bandwidth, GB/s: elementwise kernels and the optimizer step
    gemm_tflops: list[list[float]]  # [FLOPs of one GEMM (2 m n k), achieved bf16 TFLOP/s]
    grouped_gemm_factor: float  # routed experts' grouped GEMMs run at this share of a dense GEMM of the same size
    attention_tflops: list[list[float]]  # [query tokens of one rank's sequence, achieved TFLOP/s by 6 S h per token]
    elementwise_passes: float  # bytes moved by norms, activations, RoPE, casts per byte autograd keeps
    fp8_gemm_speedup: float  # an FP8 block GEMM's speed over bf16
    fp8_cast_fraction: float  # FP8 amax/cast/transpose time per unit of bf16 block GEMM time
    nvlink: dict[str, list[list[float]]]  # collective -> [tensor bytes, bus GB/s] inside a node
    inter_node_gbps: float  # network per GPU, Gbit/s (400: one NDR InfiniBand port per GPU)
    network_efficiency: float  # share of the line rate NCCL reaches across nodes
    dp_overlap: float  # share of the gradient reduce-scatter hidden behind the last backward
    fsdp_overlap: float  # share of FSDP2's gathers and reduce-scatters hidden behind the GPU's work (the rest hides only in host waits)
    step_overhead_ms: float  # host work per step (data, logging, the optimizer's launches)
    microbatch_overhead_ms: float  # host work per micro batch and pipeline chunk (launches, schedule)
    # The host's time to launch one block's forward + backward of one micro batch ("dense", "moe"),
    # ms: a block's GPU work cannot take less (``step_time``), and at small micro batches, many
    # ranks and MoE dispatch it takes more than the GPU's
    host_ms_per_block: dict[str, float] = field(default_factory=dict)
    # The same under full recompute, where measured (files before it: ``host_factors["recompute"]``
    # times the above; ``host_ms``)
    host_ms_per_block_recompute: dict[str, float] = field(default_factory=dict)
    # Per layout feature (HOST_FEATURES), that host time's factor with the feature on: each adds its
    # factor less one of the time; cp's is the one at cp 2, and each further ring step adds as much
    # again; "recompute" stands in where host_ms_per_block_recompute was not measured (``step_time``)
    host_factors: dict[str, float] = field(default_factory=dict)
    # Host work, as a share of the MoE block's host time, that FSDP2 ("fsdp") and expert tensor
    # parallelism ("etp") put after the expert dispatch's host sync, when the GPU's queue is empty:
    # under ep or etp the GPU waits for it (``step_time``)
    synced_host_shares: dict[str, float] = field(default_factory=dict)
    # [rows per expert, grouped_gemm_factor there], where measured: a grouped GEMM's share of dense
    # speed grows with its rows (DeepSeek-V2-Lite's experts on an H200: 0.65 at one sequence's 384
    # rows, 0.81-0.85 from two sequences on); files without it take grouped_gemm_factor at any size
    grouped_gemm_curve: list[list[float]] = field(default_factory=list)
    # How the host's and the GPU's times of a block combine: (host^p + GPU^p)^(1/p), the larger one
    # where they differ, more than it where they are close (``step_time``)
    host_overlap_power: float = 4.0
    # Share of the calibrated GEMM and attention rates a training step sustains: the calibration
    # times each kernel alone for a moment, a step runs them back to back for minutes
    sustained_share: float = 1.0
    on_paper: bool = False  # no number measured on this GPU kind
    sources: dict[str, str] = field(default_factory=dict)

    def grouped_factor(self, rows: float) -> float:
        """The grouped expert GEMMs' share of dense speed at ``rows`` per expert."""
        return interpolate(self.grouped_gemm_curve, rows) if self.grouped_gemm_curve else self.grouped_gemm_factor

    def host_ms(self, kind: str, full_recompute: bool) -> float:
        """The host's milliseconds for one block of ``kind``'s forward + backward: measured under
        full recompute where the file has it, else the plain time times the fitted factor."""
        if full_recompute and kind in self.host_ms_per_block_recompute:
            return self.host_ms_per_block_recompute[kind]
        return self.host_ms_per_block.get(kind, 0.0) * (self.host_factors.get("recompute", 1.0) if full_recompute else 1.0)

    def gemm_rate(self, flops: float) -> float:
        """Achieved FLOP/s of one bf16 GEMM of ``flops``."""
        return 1e12 * self.sustained_share * interpolate(self.gemm_tflops, flops)

    def attention_rate(self, tokens: float) -> float:
        return 1e12 * self.sustained_share * interpolate(self.attention_tflops, tokens)

    def bus_bandwidth(self, op: str, nbytes: float, spans_nodes: bool) -> float:
        """Bytes/s of collective ``op`` on a tensor of ``nbytes`` (NCCL's bus bandwidth)."""
        inside = 1e9 * interpolate(self.nvlink[op], nbytes)
        if not spans_nodes:
            return inside
        return min(inside, self.inter_node_gbps / 8 * 1e9 * self.network_efficiency)

    def collective_seconds(self, op: str, nbytes: float, group: int, spans_nodes: bool) -> float:
        """Time of ``op`` over ``group`` ranks on a tensor of ``nbytes`` (the gathered or reduced
        whole; for all-to-all and p2p the bytes one rank sends)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        moved = nbytes if op == "p2p" else nbytes * (group - 1) / group
        return moved / self.bus_bandwidth(op, nbytes, spans_nodes) * (2 if op == "all_reduce" else 1)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, indent=1)


def shipped_for(device: str) -> str:
    """The shipped machine closest to a GPU named ``device`` (as torch names it)."""
    return "h200" if "H200" in device else "mi300x" if "MI3" in device else "h100"


def load(name_or_path: str) -> Machine:
    """A shipped machine (``h100``, ``h200``, ``mi300x``) or a calibration file."""
    path = DEFAULTS / SHIPPED[name_or_path.lower()] if name_or_path.lower() in SHIPPED else Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--gpu / --calibration {name_or_path}: neither a shipped machine ({', '.join(SHIPPED)}) nor a file")
    raw = json.loads(path.read_text())
    if path.parent != DEFAULTS:
        shipped = load(shipped_for(raw.get("device", "")))
        raw.update({name: getattr(shipped, name) for name in ADDED_FIELDS if name not in raw})
        raw.update({name: getattr(shipped, name) for name in FITTED_FIELDS})
        raw["sources"] = {**raw.get("sources", {}), **{name: shipped.sources[name] for name in FITTED_FIELDS if name in shipped.sources}}
    known = {f.name for f in fields(Machine)}
    unknown = sorted(set(raw) - known)
    missing = sorted(f.name for f in fields(Machine) if f.name not in raw and f.name not in OPTIONAL_FIELDS)
    if unknown or missing:
        raise ValueError(f"{path}: unknown fields {unknown}, missing fields {missing}; write it with meshtron plan --calibrate")
    return Machine(**raw)
