"""``benchmarks/moe_host_calls.py``: B4's MoE layer cut into the parts its forward calls, each
part's aten ops, Triton launches and autograd nodes counted forward and backward (the reference
path on the CPU here; the kernel path is the GPU's, or the CPU's under Triton's interpreter)."""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_part_is_counted_and_the_total_is_their_sum(tmp_path):
    out = tmp_path / "calls.json"
    run = [sys.executable, "moe_host_calls.py", "--device", "cpu", "--fused-kernels", "off", "--tokens", "64", "--repeat", "2",
           "--json", str(out)]  # fmt: skip
    stdout = subprocess.run(run, cwd=BENCHMARKS, capture_output=True, text=True, check=True).stdout
    rows = json.loads(out.read_text())
    for part in ("router", "dispatch plan", "permute", "routed experts", "shared experts", "combine"):
        assert f"| {part} |" in stdout and rows[part]["fwd_ops"] > 0, part
    # The router's backward runs its nodes: the gate, the softmax and top-k, the balancing loss (in the router).
    assert rows["router"]["bwd_nodes"] == rows["router"]["fwd_nodes"] > 3
    assert rows["dispatch plan"]["bwd_ops"] == 0  # the plan is integers: no backward
    for key in ("fwd_ops", "bwd_ops", "fwd_nodes", "bwd_nodes", "fwd_launches"):
        assert rows["total"][key] == sum(row[key] for part, row in rows.items() if part != "total"), key
    assert rows["total"]["fwd_launches"] == 0  # kernels off: no Triton
