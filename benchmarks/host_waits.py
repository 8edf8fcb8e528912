"""Where a step makes the GPU wait for the host: its synchronizing calls, and its idle gaps.

    python benchmarks/host_waits.py TRACE.json.gz [--top 15]   (a trace from ``--profile ... --trace``)

``find_syncs(step, path)`` runs a step with CUDA's sync debug mode on and writes each call site
that made the host wait for the GPU (``.item()``, ``.tolist()``, ``nonzero``, a blocking copy),
with its count and Python stack. ``gaps(trace)`` reads a profiler's Chrome trace and lists the
GPU's longest idle gaps, each with when the host launched the kernel that ended it and the host
calls running in between: a launch late by the gap's length means the host was behind (launch
overhead, or a sync before it), not the GPU.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import traceback
import warnings

import torch

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def find_syncs(step, path: str, steps: int = 2) -> int:
    """Run ``steps`` steps in sync debug mode; write the distinct synchronizing call sites to
    ``path`` (most frequent first). Returns how many syncs the steps made."""
    sites: collections.Counter = collections.Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        sites["".join(traceback.format_list(frames[-8:])) + f"  -> {str(message).splitlines()[0]}\n"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    with open(path, "w") as f:
        f.write(f"{sum(sites.values())} synchronizing calls in {steps} steps, {len(sites)} call sites\n\n")
        for site, count in sites.most_common():
            f.write(f"=== {count} x\n{site}\n")
    return sum(sites.values())


def gaps(trace_path: str, top: int = 15) -> str:
    """The ``top`` longest GPU idle gaps in a Chrome trace, with the host's view of each."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    host = sorted((e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function")), key=lambda e: e["ts"])
    found, busy_until, before = [], None, None
    for e in gpu:
        if busy_until is not None and e["ts"] > busy_until:
            found.append((e["ts"] - busy_until, busy_until, before, e))
        if busy_until is None or e["ts"] + e["dur"] > busy_until:
            busy_until, before = e["ts"] + e["dur"], e
    total = sum(g for g, *_ in found)
    lines = [f"GPU idle {total / 1000:.2f} ms in {len(found)} gaps; the longest {top}:"]
    for gap, start, before, after in sorted(found, key=lambda g: -g[0])[:top]:
        launch = launches.get(after["args"].get("correlation"))
        late = "" if launch is None else f", launched {(launch['ts'] - start) / 1000:+.3f} ms after the gap began by {launch['name']}"
        lines.append(f"\n{gap / 1000:.3f} ms at {start / 1000:.3f}: after {before['name'][:70]}\n    before {after['name'][:70]}{late}")
        shown = 0
        for h in host:
            if h["ts"] > (launch["ts"] if launch else start + gap) or shown == 25:
                break
            if h["ts"] + h["dur"] >= start - 200 and h["dur"] >= 20:
                shown += 1
                lines.append(f"      host {h['cat']:12s} {(h['ts'] - start) / 1000:+8.3f} ms  {h['dur'] / 1000:7.3f} ms  {h['name'][:80]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(gaps(args.trace, args.top))


if __name__ == "__main__":
    main()
