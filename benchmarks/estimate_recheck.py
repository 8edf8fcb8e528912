"""Every measured peak in ``benchmarks/data`` against this tree's ``meshtron estimate``, on the CPU.

    PYTHONPATH=$PWD python benchmarks/estimate_recheck.py [--rows]

For each CSV row of ``plan_check.py`` or ``layout_recheck.py`` with a peak (a run that failed
still reports one when it logged a step), the layout is read back from its ``layout`` column
(``layout_recheck.parse``), applied to the workload's config (``plan_check.planned_config``) and
estimated (``estimate.estimate``). The row's own ``estimate_gib`` is the estimate when it ran.

Every row but those of ``AFTER_RERUN_FIX`` was measured before ``models/recompute.py`` kept a
mixture-of-experts layer from holding its checkpoint rerun's auxiliary losses. Under full recompute each MoE block the backward
had passed then kept its rerun's graph from those losses back to the block's input, and the
activations it saved (``rerun_graph_bytes_per_token``), until the step's end. The ``+ kept`` column
adds that to the estimate: at the backward's last MoE block all but one of the stage's MoE blocks
hold it, while the output layer's loss workspace, counted at the backward's start, is gone.

Prints every row (``--rows``) and then the rows grouped by feature: expert parallelism (ep, etp
or none), how data-parallel ranks shard state (dist-opt, fsdp, none), recompute (full,
selective, none), the micro batch, pp and tp: each group's mean, lowest and highest error in
percent of the peak, of the estimate and of the estimate plus what the rows' code kept. Negative:
below the peak (the unsafe side).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layout_recheck import parse  # noqa: E402
from plan_refit import DATA, GRIDS, workload  # noqa: E402

from meshtron.config import Config  # noqa: E402
from meshtron.estimate import (  # noqa: E402
    DTYPE_BYTES,
    GIB,
    activation_bytes_per_token_layer,
    estimate,
    first_stage_blocks,
    moe_bytes_per_token,
    token_shard,
)
from meshtron.models import spec_for  # noqa: E402
from meshtron.planning.layouts import Layout, apply  # noqa: E402

# Every CSV with peaks: the step-time refit's grids, and the grid it skips for its calibration (its peaks stand).
FILES = [(name, work, layers) for name, _, work, layers in GRIDS] + [("plan_check_4xH200_deepseek.csv", "deepseek", 27)]
# Measured after the fix (models/recompute.py): their code held no rerun graph.
AFTER_RERUN_FIX = {"plan_recheck_2xH200_deepseek_s8.csv"}


@dataclass
class Row:
    workload: str
    layout: Layout
    then_gib: float  # the estimate when the row was measured
    peak_gib: float
    now_gib: float = 0.0
    kept_gib: float = 0.0  # what the rows' code kept beyond the estimate (``held_rerun_graphs``)

    def error_pct(self, kept: bool = False) -> float:
        """(estimate - peak) / peak, in percent; ``kept``: with what the rows' code held beyond it."""
        return 100 * (self.now_gib + (self.kept_gib if kept else 0.0) - self.peak_gib) / self.peak_gib

    def features(self) -> dict[str, str]:
        lay = self.layout
        expert = "ep+etp" if lay.ep > 1 and lay.etp > 1 else "ep" if lay.ep > 1 else "etp" if lay.etp > 1 else "no ep/etp"
        sharding = {"distributed-optimizer": "dist-opt", "fsdp": "fsdp", "none": "-"}[lay.sharding]
        return {"experts": expert, "sharding": sharding, "recompute": lay.recompute or "none", "mbs": f"mbs{lay.micro_batch}",
                "pp": "pp>1" if lay.pp > 1 else "pp1", "tp": "tp>1" if lay.tp > 1 else "tp1"}  # fmt: skip


def rerun_graph_bytes_per_token(cfg: Config) -> float:
    """Per token, what a MoE block's checkpoint rerun kept alive from its auxiliary losses back to
    the block's input: everything the block keeps for backward (``activation_bytes_per_token_layer``)
    but its input (the checkpoint keeps that anyway) and the experts' part of
    ``moe_bytes_per_token``, of which the router's fp32 scores [E] (twice) are on the path."""
    a, m = DTYPE_BYTES[cfg.train.precision], cfg.model
    block = activation_bytes_per_token_layer(cfg, is_moe=True) - moe_bytes_per_token(cfg, a)
    return block - a * m.hidden_size / token_shard(cfg) + 2 * 4 * m.num_experts / token_shard(cfg)


def held_rerun_graphs(cfg: Config, world: int, loss_bytes: int) -> float:
    """Bytes the rows' code held at its peak beyond the estimate under full recompute: the reruns of
    all but one of the stage's MoE blocks (see the module docstring), less the loss workspace."""
    if cfg.model.recompute_granularity != "full" or not cfg.model.num_experts:
        return 0.0
    shapes = spec_for(cfg.model).block_shapes(cfg)
    stage = [shapes[i] for i in first_stage_blocks(cfg, len(shapes), world)]
    tokens = cfg.train.micro_batch_size * max(b.tokens for b in stage) / cfg.parallel.context_parallel
    held = (sum(b.moe for b in stage) - 1) * tokens * rerun_graph_bytes_per_token(cfg)
    return max(0.0, held - loss_bytes)


def measured_rows() -> list[Row]:
    """Every row with a peak, estimated with this tree."""
    rows = []
    for name, work, layers in FILES:
        cfg = workload(work, layers)
        with open(DATA / name, newline="") as f:
            for r in csv.DictReader(f):
                if not r["peak_gib"] or float(r["peak_gib"]) <= 0:
                    continue
                layout = parse(r["layout"])
                row = Row(f"{work} x {layers}", layout, float(r["estimate_gib"]), float(r["peak_gib"]))
                planned = apply(cfg, layout)
                now = estimate(planned, layout.world)
                row.now_gib = now.total_bytes / GIB
                if name not in AFTER_RERUN_FIX:
                    row.kept_gib = held_rerun_graphs(planned, layout.world, now.loss_bytes) / GIB
                rows.append(row)
    return rows


def group_line(label: str, rows: list[Row]) -> str:
    """A group's rows: mean and lowest error of the estimate, then of the estimate plus what the rows' code kept."""
    parts = []
    for kept in (False, True):
        pct = [r.error_pct(kept) for r in rows]
        parts.append(f"mean {statistics.mean(pct):+5.1f} %  lowest {min(pct):+5.1f} %  highest {max(pct):+5.1f} %")
    return f"  {label:<24} {len(rows):>3} rows | estimate: {parts[0]} | + kept: {parts[1]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", action="store_true", help="print every row")
    args = parser.parse_args()
    rows = measured_rows()
    if args.rows:
        print("| workload | GPUs | layout | estimate then | estimate now | + kept | peak | now | now + kept |")
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r.workload} | {r.layout.world} | {r.layout.short()} | {r.then_gib:.1f} | {r.now_gib:.1f} | {r.kept_gib:.1f} | "
                  f"{r.peak_gib:.1f} | {r.error_pct():+.1f} % | {r.error_pct(True):+.1f} % |")  # fmt: skip
    print(group_line("all", rows))
    moe = [r for r in rows if r.workload.startswith("deepseek")]
    for feature in ("experts", "sharding", "recompute", "mbs", "pp", "tp"):
        print(f"by {feature} (DeepSeek rows):")
        for value in sorted({r.features()[feature] for r in moe}):
            print(group_line(value, [r for r in moe if r.features()[feature] == value]))
    print("by experts x recompute (DeepSeek rows):")
    for key in sorted({(r.features()["experts"], r.features()["recompute"]) for r in moe}):
        print(group_line(" + ".join(key), [r for r in moe if (r.features()["experts"], r.features()["recompute"]) == key]))
    dense = [r for r in rows if not r.workload.startswith("deepseek")]
    print("by recompute (dense rows):")
    for value in sorted({r.features()["recompute"] for r in dense}):
        print(group_line(value, [r for r in dense if r.features()["recompute"] == value]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
