"""B3 (Llama-3-8B layers x 8, 128 K vocabulary, seq 8192, micro batch 1, global batch 1) in bf16
and under FP8 recipes, one training process per side, on one GPU:

    python benchmarks/b3_fp8_recipes.py [--steps 6] [--warmup 3] [--sides bf16,delayed,blockwise] [--global-batch-size 8]

Sides: ``bf16``; ``delayed`` (``--fp8-format hybrid``, the default recipe: B3's FP8 figure in issue
31), ``delayed_head`` (the same with ``--fp8-output-layer``: the output layer's GEMMs in FP8 too),
``tensorwise`` (hybrid), ``rowwise`` and ``blockwise`` (``--fp8-format e4m3 --fp8-recipe
blockwise``, DeepSeek-V3's 1 x 128 / 128 x 128 scales). Each side is ``train_bench.py`` on the
training loop with mock data (steps timed with CUDA events after warm-up); the table gives tokens/s,
model TFLOP/s (bf16-equivalent FLOPs, as every B3 figure), step time, peak memory, the ratio to
bf16, and the losses of the timed steps (the same data on every side: FP8 should stay close).

``--global-batch-size N`` runs every side with N sequences a step (N micro batches of 1: gradient
accumulation), where each FP8 weight is cast once for the step's micro batches
(``kernels/step_cache.py``); against the same sides on the tree before that, it measures the casts saved.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

B3 = ["--preset", "llama3-8b", "--num-layers", "8", "--seq-length", "8192", "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16"]
SIDES = {
    "bf16": [],
    "delayed": ["--fp8-format", "hybrid", "--fp8-backend", "meshtron"],
    "delayed_head": ["--fp8-format", "hybrid", "--fp8-backend", "meshtron", "--fp8-output-layer"],
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-backend", "meshtron"],
    "rowwise": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}


def run_side(name: str, flags: list[str], steps: int, warmup: int, limit: int) -> dict | None:
    """``train_bench.py`` on ``flags`` in its own process -> its result (None, said why, if it failed)."""
    cmd = [sys.executable, "train_bench.py", "--steps", str(steps), "--warmup", str(warmup), "--", *flags]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"{name}: over {limit} s, stopped", flush=True)
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]  # train_bench's result: one JSON line
    if proc.returncode != 0 or not lines:
        print(f"{name}: failed (exit {proc.returncode}) after {time.perf_counter() - start:.0f} s\n{proc.stderr[-3000:]}", flush=True)
        return None
    for line in proc.stderr.splitlines():  # say so when blockwise fell back from cuBLAS to its Triton GEMM
        if "_scaled_mm" in line:
            print(f"{name}: {line.strip()}", flush=True)
    result = json.loads(lines[-1])
    result["wall_s"] = time.perf_counter() - start
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def compare(workload: str, flags: list[str], sides: dict[str, list[str]], default_sides: str, doc: str) -> None:
    """The command line of a recipe comparison: each side ``flags`` plus its own, timed in its own process, then the table."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sides", default=default_sides, help=f"comma-separated, of {', '.join(sides)}")
    parser.add_argument("--limit", type=int, default=150, help="seconds each side may take, start-up included")
    parser.add_argument("--global-batch-size", type=int, default=0,
                        help="sequences a step on every side (micro batches of the workload's size); 0: the workload's own")  # fmt: skip
    args = parser.parse_args()
    chosen = args.sides.split(",")
    unknown = [s for s in chosen if s not in sides]
    if unknown:
        parser.error(f"unknown sides {unknown}; choose from {', '.join(sides)}")
    batch = ["--global-batch-size", str(args.global_batch_size)] if args.global_batch_size else []  # last: it wins
    results = {name: run_side(name, flags + sides[name] + batch, args.steps, args.warmup, args.limit) for name in chosen}
    print_table(workload + (f", global batch {args.global_batch_size}" if batch else ""), results, args.steps, args.warmup)


def print_table(workload: str, results: dict[str, dict | None], steps: int, warmup: int) -> None:
    """The sides' table, each against the ``bf16`` side."""
    base = results.get("bf16")
    print(f"\n{workload} on {next((r['device'] for r in results.values() if r), '?')}, {steps} timed steps after {warmup}")
    print("| side | tokens/s | TFLOP/s | step ms | peak GiB | vs bf16 | losses of the timed steps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        if r is None:
            print(f"| {name} | failed | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else "-"
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {1000 * r['step_s']:.1f} | {r['peak_gib']:.1f} | {ratio} | "
              f"{' '.join(f'{x:.3f}' for x in r['losses'][warmup:])} |")  # fmt: skip


if __name__ == "__main__":
    compare("B3", B3, SIDES, "bf16,delayed,blockwise", __doc__)
