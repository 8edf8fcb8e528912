"""Where a profiled step's GPU time went, by kernel family, from a Chrome trace (``b5_scaling.py --trace-dir``,
``train_bench.py --trace``):

    python benchmarks/kernel_sums.py trace_tp4.json.gz [trace_dp1.json.gz ...] [--gaps N]

Per trace: the step's span, the time some kernel ran (busy, the union over streams), and the summed
kernel time per family (GEMM, attention, NCCL, our Triton kernels, elementwise/reduction, other),
with each family's time that no other family overlapped (``alone``): what a family costs the step.
``--gaps N``: the N longest stretches with no kernel running, each with the kernels around it and the
host's operators and runtime calls that overlapped it (what the GPU waited for).
"""

from __future__ import annotations

import gzip
import json
import re
import sys

FAMILIES = (
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|cudnn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm100_|matmul|_mm_|splitk", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|reduce|copy|fill|cat|index", re.I)),
    ("triton", re.compile(r"^triton|^_")),  # Triton kernels are named after their Python function
)


def family(name: str) -> str:
    return next((fam for fam, pattern in FAMILIES if pattern.search(name)), "other")


def union(intervals: list[tuple[float, float]]) -> list[list[float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def covered(intervals: list[tuple[float, float]], by: list[list[float]]) -> float:
    """Total length of ``intervals`` that lies under the union ``by`` (both in µs)."""
    total, j = 0.0, 0
    for a, b in sorted(intervals):
        while j < len(by) and by[j][1] <= a:
            j += 1
        k = j
        while k < len(by) and by[k][0] < b:
            total += max(0.0, min(b, by[k][1]) - max(a, by[k][0]))
            k += 1
    return total


def summarize(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    spans = {fam: [(e["ts"], e["ts"] + e["dur"]) for e in kernels if family(e["name"]) == fam] for fam, _ in (*FAMILIES, ("other", None))}
    every = [iv for ivs in spans.values() for iv in ivs]
    start, end = min(a for a, _ in every), max(b for _, b in every)
    lines = [f"{path}: span {(end - start) / 1000:.1f} ms, busy {sum(b - a for a, b in union(every)) / 1000:.1f} ms"]
    for fam, ivs in spans.items():
        if not ivs:
            continue
        others = union([iv for other, o in spans.items() if other != fam for iv in o])
        total = sum(b - a for a, b in ivs)
        alone = sum(b - a for a, b in union(ivs)) - covered([tuple(iv) for iv in union(ivs)], others)
        lines.append(f"  {fam:<12} {total / 1000:8.1f} ms in {len(ivs):5d} kernels, alone {alone / 1000:8.1f} ms")
    top = sorted(kernels, key=lambda e: -e["dur"])
    by_name: dict[str, float] = {}
    for e in top:
        by_name[e["name"][:90]] = by_name.get(e["name"][:90], 0.0) + e["dur"]
    for name, dur in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]:
        lines.append(f"    {dur / 1000:8.1f} ms  {name}")
    return "\n".join(lines)


def gaps(path: str, count: int) -> str:
    """The ``count`` longest idle stretches between kernels and what the host did meanwhile."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation") and "dur" in e]
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    holes = sorted(((b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:])), reverse=True)[:count]
    lines = [f"{path}: the {count} longest GPU gaps"]
    for length, start, end in holes:
        before = [e["name"][:60] for e in kernels if e["ts"] + e["dur"] <= start][-2:]
        after = [e["name"][:60] for e in kernels if e["ts"] >= end][:2]
        lines.append(f"  {length / 1000:.3f} ms: after {before} before {after}")
        overlap: dict[str, float] = {}
        for e in host:
            inside = min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
            if inside > 0:
                overlap[f"{e['cat']}:{e['name'][:70]}"] = overlap.get(f"{e['cat']}:{e['name'][:70]}", 0.0) + inside
        for name, dur in sorted(overlap.items(), key=lambda kv: -kv[1])[:8]:
            lines.append(f"      {dur / 1000:7.3f} ms  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    count = int(args[args.index("--gaps") + 1]) if "--gaps" in args else 0
    for trace in [a for i, a in enumerate(args) if a != "--gaps" and (i == 0 or args[i - 1] != "--gaps")]:
        print(summarize(trace))
        if count:
            print(gaps(trace, count))
