"""``benchmarks/host_waits.py``: a GPU gap in a Chrome trace is found, with when the host launched
the kernel ending it and the host call that ran before (here a 2 ms sync)."""

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from host_waits import gaps  # noqa: E402


def test_a_gap_names_its_late_launch_and_the_sync_before_it(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000, "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": -50, "dur": 5, "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 100, "dur": 2000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2150, "dur": 5, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "norm", "ts": 2160, "dur": 100, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "add", "ts": 2261, "dur": 10, "args": {"correlation": 3}},
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    report = gaps(str(path), top=1)
    assert report.startswith("GPU idle 1.16 ms in 2 gaps")
    assert "1.160 ms at 1.000: after gemm\n    before norm, launched +1.150 ms after the gap began by cudaLaunchKernel" in report
    assert "cudaStreamSynchronize" in report and "before add" not in report
