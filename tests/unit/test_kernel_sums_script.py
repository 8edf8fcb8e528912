"""``benchmarks/kernel_sums.py``: a profiled step's kernel time by family, and ``--gaps``: the longest
stretches with no kernel running and the host work that overlapped each, on a made-up trace."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

EVENTS = [  # µs: a GEMM, 40 µs idle while the host syncs on an item(), then a GEMM and a Triton kernel
    {"cat": "kernel", "name": "nvjet_gemm_a", "ts": 0, "dur": 10},
    {"cat": "kernel", "name": "nvjet_gemm_b", "ts": 50, "dur": 10},
    {"cat": "kernel", "name": "_cast_kernel", "ts": 62, "dur": 5},
    {"cat": "cpu_op", "name": "aten::item", "ts": 12, "dur": 30},
    {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 5, "dur": 40},
    {"cat": "cpu_op", "name": "aten::add", "ts": 100, "dur": 5},
]


def test_families_and_the_longest_gap_with_its_host_work(tmp_path):
    trace = tmp_path / "trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    out = subprocess.run([sys.executable, "kernel_sums.py", str(trace), "--gaps", "1"], cwd=BENCHMARKS, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert "span 0.1 ms, busy 0.0 ms" in out and "gemm" in out and "triton" in out
    gap = out.split("the 1 longest GPU gaps")[1].splitlines()
    assert gap[1].startswith("  0.040 ms: after ['nvjet_gemm_a'] before ['nvjet_gemm_b', '_cast_kernel']")
    assert "cuda_runtime:cudaStreamSynchronize" in gap[2] and "0.035 ms" in gap[2]  # 10..45 of the 10..50 gap
    assert "cpu_op:aten::item" in gap[3] and "0.030 ms" in gap[3]
    assert "aten::add" not in out  # after the gap: not counted
