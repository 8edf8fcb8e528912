"""benchmarks/b8_encoders.py --model both --tiny: both sides train a tiny post-LN BERT and a tiny T5
on the CPU and the table reports a throughput and a ratio for each model (the script's smoke
test; the timing itself is the GPU run's)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "b8_encoders.py"
LOSS = r"(\d+\.\d+)->\d+\.\d+"


@pytest.mark.slow
def test_tiny_bert_and_t5_run_both_sides_on_the_cpu():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "both", "--tiny", "--steps", "2", "--warmup", "0"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "failed" not in proc.stdout
    for model in ("bert", "t5"):
        row = re.search(rf"^{model}\s+\S+\s+\S+\s+([\d,]+)\s+([\d,]+)\s+\d+\.\d+x\s+\S+ / \S+\s+- / -\s+{LOSS} / {LOSS}$",
                        proc.stdout, re.MULTILINE)  # fmt: skip
        assert row, proc.stdout
        assert int(row[1].replace(",", "")) > 0 and int(row[2].replace(",", "")) > 0
        # about ln(4224) = 8.35 at the start on both sides (HF's T5 initialises its logits a little wider)
        assert 7.0 < float(row[3]) < 9.5 and 7.0 < float(row[4]) < 9.5, row[0]
