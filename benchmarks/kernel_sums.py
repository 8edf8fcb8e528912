"""Where a profiled step's GPU time went, by kernel family, from a Chrome trace (``b5_scaling.py --trace-dir``):

    python benchmarks/kernel_sums.py trace_tp4.json.gz [trace_dp1.json.gz ...]

Per trace: the step's span, the time some kernel ran (busy, the union over streams), and the summed
kernel time per family (GEMM, attention, NCCL, our Triton kernels, elementwise/reduction, other),
with each family's time that no other family overlapped (``alone``): what a family costs the step.
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


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print(summarize(trace))
