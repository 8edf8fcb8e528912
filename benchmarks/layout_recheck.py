"""Named layouts of one ``plan_check.py`` workload, predicted and run: the planner's new first
choice after a model change, or a layout that failed, checked without a whole grid.

    PYTHONPATH=$PWD python benchmarks/layout_recheck.py --out $OUT --workload deepseek --gpus 2 \
        --calibration benchmarks/data/calibration_2xH200_deepseek.json \
        --layouts "tp1 pp1 dp2 ep2 mbs4 dist-opt rc-full bf16-moments;tp1 pp2v7 dp1 mbs2 - rc-full bf16-moments"

Each layout is written as the planner's report writes it (``Layout.short``). Predicted with this
tree's step model and the calibration file, memory by ``estimate``, then trained ``--steps``
steps through ``meshtron train`` (``planning.measure.run_layout``). Writes ``layout_recheck.md``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plan_check import WORKLOADS, add_layer_counts, planned_config  # noqa: E402

from meshtron.estimate import estimate  # noqa: E402
from meshtron.planning.hardware import load  # noqa: E402
from meshtron.planning.layouts import Layout, apply  # noqa: E402
from meshtron.planning.measure import run_layout  # noqa: E402
from meshtron.planning.step_time import StepModel  # noqa: E402

SHARDING = {"dist-opt": "distributed-optimizer", "fsdp": "fsdp", "-": "none"}


def parse(short: str) -> Layout:
    """The layout ``Layout.short`` printed as ``short``."""
    sizes = dict(tp=1, pp=1, vp=1, cp=1, ep=1, etp=1, dp=1, mbs=1)
    words = short.split()
    for word in words:
        if m := re.fullmatch(r"pp(\d+)v(\d+)", word):
            sizes["pp"], sizes["vp"] = int(m[1]), int(m[2])
        elif m := re.fullmatch(r"(tp|pp|cp|ep|etp|dp|mbs)(\d+)", word):
            sizes[m[1]] = int(m[2])
    sharding = SHARDING[next(w for w in words if w in SHARDING)]
    recompute = {"rc-sel": "selective", "rc-full": "full"}.get(next((w for w in words if w.startswith("rc-")), ""), "")
    layout = Layout(sizes["tp"], sizes["pp"], sizes["vp"], sizes["cp"], sizes["ep"], sizes["etp"], sizes["dp"], sharding, sizes["mbs"],
                    recompute, bf16_moments="bf16-moments" in words, fp8="fp8" in words)  # fmt: skip
    if layout.short() != short:
        raise ValueError(f"'{short}' reads back as '{layout.short()}': write it as the planner's report does")
    return layout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    add_layer_counts(parser)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--calibration", default="h200")
    parser.add_argument("--layouts", required=True, help="';'-separated, as the planner's report writes them")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layout-timeout-s", type=float, default=150.0)
    args = parser.parse_args()
    layouts = [parse(s.strip()) for s in args.layouts.split(";")]  # a typo fails here, before any run
    flags = WORKLOADS[args.workload](args)
    cfg = planned_config(flags)
    model = StepModel(cfg, load(args.calibration), args.gpus)
    lines = ["| layout | predicted | measured | error | estimate GiB | peak GiB | note |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for layout in layouts:
        predicted = model.predict(layout, exact_split=True).tokens_per_s_gpu
        gib = estimate(apply(cfg, layout), layout.world).total_bytes / 2**30
        got = run_layout(flags, layout, args.steps, timeout_s=args.layout_timeout_s)
        error = f"{100 * (predicted / got.tokens_per_s_gpu - 1):+.1f} %" if got.tokens_per_s_gpu else ""
        note = "" if got.tokens_per_s_gpu else "failed: " + got.error.replace("\n", " ")  # the first error line and two after
        lines.append(f"| {layout.short()} | {predicted:,.0f} | {got.tokens_per_s_gpu:,.0f} | {error} | {gib:.1f} | {got.peak_gib} | {note} |")
        print(lines[-1], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    text = "\n".join([f"{args.workload} on {args.gpus} GPUs, calibration {args.calibration}", "", *lines, ""])
    (Path(args.out) / "layout_recheck.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
