"""``meshtron plan`` against measurement on this machine's GPUs, one workload per device call of
under ten minutes.

    PYTHONPATH=$PWD python benchmarks/plan_check.py --out $OUT --workloads llama [--gpus 2] [--budget-s 520]

1. ``meshtron plan --calibrate`` on the first workload's shapes, timed (it must take under 60 s);
   each call calibrates, since the GEMM, attention and grouped-expert shapes are the workload's own;
2. for each workload — the issue's three: Llama-3-8B x ``--llama-layers`` (32) at seq 8192,
   DeepSeek-V2-Lite x ``--deepseek-layers`` (27, layer 0 dense) at seq 4096, Llama-3-70B layers x
   ``--llama70b-layers`` (12) at seq 8192; global batch 8 — the planner checks every
   layout on all the GPUs (memory by ``estimate``, validation) with the calibration, and a grid of
   ``--per-workload`` fitting layouts is picked: the planner's first choice, then layouts spread
   over its ranking;
3. each grid layout trains ``--steps`` steps through ``meshtron train`` under torchrun
   (``planning.measure.run_layout``); then the layouts named by ``--also`` (rows ranked "also":
   known hard cases, measured on the same host as the grid; "pruned" where the planner's check
   refuses them or finds them over memory, its reason in the note); then, time permitting, the fastest
   layout the planner pruned for memory, to see it fail.

Writes ``plan_check.csv`` and ``plan_check.md`` (predicted against measured tokens/s per GPU, the
estimate against the measured peak, the planner's first choice against the grid's best) to
``--out``. New runs stop starting once ``--budget-s`` is spent; those are listed as not run.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.config import build_config  # noqa: E402
from meshtron.estimate import training_vocab_size  # noqa: E402
from meshtron.planning.hardware import load  # noqa: E402
from meshtron.planning.layouts import Space  # noqa: E402
from meshtron.planning.measure import run_layout  # noqa: E402
from meshtron.planning.search import check, search  # noqa: E402
from meshtron.planning.step_time import StepModel  # noqa: E402

WORKLOADS = {
    "llama": lambda a: ["--model.preset", "llama3-8b", "--num-layers", str(a.llama_layers), "--seq-length", "8192",
                        "--global-batch-size", "8"],
    "deepseek": lambda a: ["--model.preset", "deepseek-v2-lite", "--num-layers", str(a.deepseek_layers), "--moe-layer-freq",
                           f"([0]+[1]*{a.deepseek_layers - 1})", "--seq-length", "4096", "--global-batch-size", "8"],
    "llama70b": lambda a: ["--model.preset", "llama3-70b", "--num-layers", str(a.llama70b_layers), "--seq-length", "8192",
                           "--global-batch-size", "8"],
}  # fmt: skip


def add_layer_counts(parser: argparse.ArgumentParser) -> None:
    """The workloads' layer counts (``WORKLOADS`` reads them), for every script that builds one."""
    parser.add_argument("--llama-layers", type=int, default=32)
    parser.add_argument("--deepseek-layers", type=int, default=27)
    parser.add_argument("--llama70b-layers", type=int, default=12)


def planned_config(flags: list[str]):
    """The config the planner sees for a workload's ``flags``: random tokens, the vocabulary padded as training pads it."""
    cfg = build_config(None, flags + ["--mock-data"])
    cfg.model.vocab_size = training_vocab_size(cfg)
    return cfg


FIELDS = ["workload", "gpus", "planner_rank", "layout", "predicted", "measured", "error_pct", "estimate_gib", "peak_gib", "note", "flags"]


def grid(fits: list, size: int) -> list:
    """The first choice, then layouts spread evenly over the rest of the ranking."""
    if len(fits) <= size:
        return list(enumerate(fits, 1))
    picks = sorted({0, *(round(i * (len(fits) - 1) / (size - 1)) for i in range(1, size))})
    return [(i + 1, fits[i]) for i in picks]


def measure(flags: list[str], layout, predicted: float, row: dict, args: argparse.Namespace, left: float) -> dict:
    """``row`` with ``layout`` and its prediction, trained ``args.steps`` steps (or marked not run
    where under a minute of the budget is ``left``), the error printed."""
    row = {**row, "layout": layout.short(), "predicted": round(predicted), "flags": " ".join(layout.flags())}
    if left < 60:
        return {**row, "note": "not run: budget spent"}
    got = run_layout(flags, layout, args.steps, timeout_s=min(left, args.layout_timeout_s))
    note = "" if got.tokens_per_s_gpu else f"failed: {got.error[:300]}"
    print(f"{row['workload']} #{row['planner_rank']} {row['layout']}: predicted {predicted:,.0f}, measured {got.tokens_per_s_gpu:,.0f} {note}",
          flush=True)  # fmt: skip
    error = round(100 * (predicted / got.tokens_per_s_gpu - 1), 1) if got.tokens_per_s_gpu else ""
    return {**row, "measured": round(got.tokens_per_s_gpu), "error_pct": error, "peak_gib": got.peak_gib, "note": note}


def write(out: Path, rows: list[dict], summary: list[str]) -> str:
    """plan_check.csv and plan_check.md as they stand (rewritten after each run: a call cut short keeps them)."""
    with open(out / "plan_check.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    table = ["| " + " | ".join(FIELDS[:-1]) + " |", "|" + " --- |" * (len(FIELDS) - 1)]
    table += ["| " + " | ".join(str(r.get(k, "")) for k in FIELDS[:-1]) + " |" for r in rows]
    text = "\n".join(["# meshtron plan: predicted against measured", "", *summary, "", *table, ""])
    (out / "plan_check.md").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default="llama,deepseek")
    add_layer_counts(parser)
    parser.add_argument("--gpus", type=int, default=0, help="plan and run on the first N GPUs (default: all of them)")
    parser.add_argument("--per-workload", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=500.0)
    parser.add_argument("--layout-timeout-s", type=float, default=180.0, help="one layout's run, start-up included")
    parser.add_argument("--no-infeasible", action="store_true", help="skip running a layout the planner pruned for memory")
    parser.add_argument("--also", default="", help="layouts to run after the grid, as the report writes them, ';'-separated")
    args = parser.parse_args()
    import torch
    from layout_recheck import parse  # it imports this module: here, not at the top

    began, out = time.time(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = args.gpus or torch.cuda.device_count()  # ranks 0..N-1 of torchrun take GPUs 0..N-1
    names = args.workloads.split(",")
    calibration = out / "calibration.json"
    start = time.time()
    subprocess.run([sys.executable, "-m", "meshtron", "plan", "--calibrate", "--calibration-out", str(calibration),
                    *WORKLOADS[names[0]](args)], check=True)  # fmt: skip
    calibrate_s = time.time() - start
    machine = load(str(calibration))
    rows, summary = [], [f"calibration: {calibrate_s:.0f} s on {machine.device} x {gpus}"]
    for name in names:
        flags = WORKLOADS[name](args)
        cfg = planned_config(flags)
        result = search(cfg, gpus, gpus, machine, Space(max_tp=gpus), top=10_000)
        chosen = grid(result.fits, args.per_workload)
        measured = []
        for rank, verdict in chosen:
            predicted = verdict.prediction.tokens_per_s_gpu
            row = measure(flags, verdict.layout, predicted, {"workload": name, "gpus": gpus, "planner_rank": rank,
                          "estimate_gib": round(verdict.memory_bytes / 2**30, 1)}, args, args.budget_s - (time.time() - began))  # fmt: skip
            rows.append(row)
            write(out, rows, summary)
            if row.get("measured"):
                measured.append((row["measured"], rank, predicted))
        for short in filter(None, args.also.split(";")):  # named layouts after the grid, on the same calibration
            layout = parse(short)
            predicted = StepModel(cfg, machine, gpus).predict(layout, exact_split=True).tokens_per_s_gpu
            status, need, why = check(cfg, layout, machine)  # run whatever the planner says: a pruned one should fail
            row = measure(flags, layout, predicted, {"workload": name, "gpus": gpus, "planner_rank": "also" if status == "fits" else "pruned",
                          "estimate_gib": round(need / 2**30, 1)}, args, args.budget_s - (time.time() - began))  # fmt: skip
            if status != "fits":
                row["note"] = f"planner: {status} ({why}); {row.get('note', '')}"
            rows.append(row)
            write(out, rows, summary)
        pruned = [v for v in result.others if v.status == "memory"]
        if pruned and not args.no_infeasible and args.budget_s - (time.time() - began) > 90:
            v = max(pruned, key=lambda v: v.prediction.tokens_per_s_gpu)
            got = run_layout(flags, v.layout, 3, timeout_s=min(args.budget_s - (time.time() - began), args.layout_timeout_s))
            oom = "out of memory" in got.error.lower() or "outofmemory" in got.error.lower()
            rows.append({"workload": name, "gpus": gpus, "planner_rank": "pruned", "layout": v.layout.short(),
                         "predicted": round(v.prediction.tokens_per_s_gpu), "estimate_gib": round(v.memory_bytes / 2**30, 1),
                         "measured": round(got.tokens_per_s_gpu), "peak_gib": got.peak_gib, "flags": " ".join(v.layout.flags()),
                         "note": "ran out of memory, as pruned" if oom else f"pruned for memory; the run said: {got.error[:300]}"})  # fmt: skip
        if measured:
            best = max(measured)
            first = next((m for m in measured if m[1] == 1), None)
            errors = [abs(p / m - 1) for m, _, p in measured]
            summary.append(f"{name}: {len(measured)} layouts measured of {len(result.fits)} that fit; grid best {best[0]:,.0f} "
                           f"(planner rank {best[1]}); planner's first choice "
                           + (f"{first[0]:,.0f} = {100 * first[0] / best[0]:.1f}% of the best" if first else "not measured")
                           + f"; |error| mean {100 * statistics.mean(errors):.1f}%, max {100 * max(errors):.1f}%")  # fmt: skip
    print(write(out, rows, summary))
    print(f"wall time {time.time() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
