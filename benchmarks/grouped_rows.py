"""The routed experts' grouped GEMM against the dense GEMM curve, by rows per expert: does
``calibrate.grouped_gemm_factor`` (measured at one sequence's rows) hold at larger micro batches?

    PYTHONPATH=$PWD python benchmarks/grouped_rows.py --sequences 1,2,4,8

For DeepSeek-V2-Lite's experts (the preset, seq 4096): per micro batch of N sequences, the factor
the step model would read, by ``calibrate.grouped_gemm_factor`` at N sequences' rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plan_check import WORKLOADS, add_layer_counts, planned_config  # noqa: E402

from meshtron.planning.calibrate import gemm_points, grouped_gemm_factor, rows_per_expert  # noqa: E402
from meshtron.planning.hardware import load, shipped_for  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", default="1,2,4,8")
    add_layer_counts(parser)
    args = parser.parse_args()
    import torch

    cfg = planned_config(WORKLOADS["deepseek"](args))
    curve = gemm_points(cfg, load(shipped_for(torch.cuda.get_device_name(0))))
    for n in map(int, args.sequences.split(",")):
        print(f"{n} sequences ({rows_per_expert(cfg, n)} rows per expert): grouped factor {grouped_gemm_factor(cfg, curve, n):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
