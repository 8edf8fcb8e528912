"""``benchmarks/b4_moe_layer.py --tiny``: the layer and its dense chain timed in rounds on the CPU,
every part printed, and the ratio given as the rounds' median with their range."""

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_tiny_layer_prints_every_part_and_the_median_ratio_of_its_rounds():
    out = subprocess.run([sys.executable, "b4_moe_layer.py", "--tiny", "--steps", "2", "--warmup", "1", "--rounds", "3"],
                         cwd=BENCHMARKS, capture_output=True, text=True, check=True).stdout  # fmt: skip
    for part in ("MoE layer (whole)", "dense chain", "router", "dispatch", "routed experts", "shared experts"):
        assert part in out
    median, low, high = map(float, re.search(r"dense chain TFLOP/s: ([\d.]+)% \(median of 3 rounds, ([\d.]+)% to ([\d.]+)%", out).groups())
    assert low <= median <= high
