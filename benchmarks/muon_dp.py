"""Muon's step-time overhead over AdamW on several GPUs, with the distributed optimizer.

    PYTHONPATH=$PWD python benchmarks/muon_dp.py --out $OUT [--gpus 2] [--steps 8] [--accumulate 1,8]

B1's model and micro batch (``llama-1.24b-bench``, seq 4096, micro batch 4, bf16 with fp32
masters), data parallel over ``--gpus`` GPUs with ``--use-distributed-optimizer``: under Muon
the layer-wise split gives each rank whole matrices to orthogonalize, then each broadcasts its
own; under AdamW each rank steps its flat range. Each row is one ``meshtron train`` under
torchrun (``planning.measure.run_layout``: tokens/s per GPU from the log, the median of the
steps after the first two) at global batch ``gpus x micro x accumulate``. The overhead is
AdamW's tokens/s over Muon's, minus one. Writes ``muon_dp.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.planning.layouts import Layout  # noqa: E402
from meshtron.planning.measure import run_layout  # noqa: E402

B1 = ["--preset", "llama-1.24b-bench", "--seq-length", "4096", "--bf16", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "2"]
MICRO = 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulate", default="1,8", help="micro batches per rank per step, comma-separated")
    args = parser.parse_args()
    layout = Layout(1, 1, 1, 1, 1, 1, args.gpus, "distributed-optimizer", MICRO)
    lines = [f"Muon against AdamW, B1's model, dp{args.gpus} with the distributed optimizer, micro batch {MICRO} x 4096 tokens",
             "", "| micro batches per rank | AdamW tokens/s/GPU | Muon tokens/s/GPU | Muon's overhead |", "| ---: | ---: | ---: | ---: |"]  # fmt: skip
    for accumulate in map(int, args.accumulate.split(",")):
        batch = ["--global-batch-size", str(args.gpus * MICRO * accumulate)]
        speeds = {}
        for optimizer in ("adam", "muon"):
            got = run_layout(B1 + batch + ["--optimizer", optimizer], layout, args.steps, timeout_s=240)
            speeds[optimizer] = got.tokens_per_s_gpu
            print(f"{optimizer} x{accumulate}: {got.tokens_per_s_gpu:,.0f} tokens/s/GPU, peak {got.peak_gib} GiB {got.error[:300]}", flush=True)
        overhead = f"{100 * (speeds['adam'] / speeds['muon'] - 1):+.1f} %" if speeds["muon"] and speeds["adam"] else "failed"
        lines.append(f"| {accumulate} | {speeds['adam']:,.0f} | {speeds['muon']:,.0f} | {overhead} |")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "muon_dp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
