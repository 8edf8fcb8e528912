"""``meshtron plan --calibrate``'s host time per block, alone and repeated, for a ``plan_check.py``
workload: the one field that host-bound layouts' predictions hang on, measured on the host that
then runs them (``layout_recheck.py``), before and after its runs.

    PYTHONPATH=$PWD python benchmarks/host_times.py --workload deepseek --repeat 2 --out $OUT/host_before.json

Writes ``{"workload": ..., "runs": [{"dense": ms, "moe": ms, "dense rc-full": ms, "moe rc-full": ms}, ...],
"mean": {...}}``: ``host_ms_per_block`` of each repeat, plain and under full recompute, and their mean.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plan_check import WORKLOADS, add_layer_counts, planned_config  # noqa: E402

from meshtron.planning.calibrate import host_ms_per_block  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    add_layer_counts(parser)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cfg = planned_config(WORKLOADS[args.workload](args))
    runs = []
    for _ in range(args.repeat):
        runs.append({**host_ms_per_block(cfg), **{f"{kind} rc-full": ms for kind, ms in host_ms_per_block(cfg, "full").items()}})
        print(json.dumps(runs[-1]), flush=True)
    mean = {kind: statistics.mean(run[kind] for run in runs) for kind in runs[0]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"workload": args.workload, "runs": runs, "mean": mean}, indent=1) + "\n")
    print("mean", json.dumps(mean))
    return 0


if __name__ == "__main__":
    sys.exit(main())
