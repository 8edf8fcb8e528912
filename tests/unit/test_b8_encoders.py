"""benchmarks/b8_encoders.py --tiny: both sides train a tiny post-LN BERT on the CPU and the table
reports a throughput for each (the script's smoke test; the timing itself is the GPU run's)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "b8_encoders.py"


def test_tiny_bert_runs_both_sides_on_the_cpu():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "bert", "--tiny", "--steps", "2", "--warmup", "1"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "failed" not in proc.stdout
    for side in ("meshtron", "hf"):
        row = re.search(rf"^{side}\s+4224\s+([\d,]+)\s+\S+\s+-\s+(\d+\.\d+)->(\d+\.\d+)\s+(\d+\.\d+)x$", proc.stdout, re.MULTILINE)
        assert row, proc.stdout
        assert int(row[1].replace(",", "")) > 0 and 7.0 < float(row[2]) < 9.5  # about ln(4224) = 8.35 at the start
