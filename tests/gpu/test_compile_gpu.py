"""``--compile`` at the B1 shape, again and again in fresh processes: a compiled step once
crashed (exit -11) in one run of several, so one passing run proves little. Each run is a new
process (new compile caches, new Triton launches), with ``faulthandler`` on so a crash prints
where it happened."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RUNS = int(os.environ.get("MESHTRON_COMPILE_RUNS", "3"))


@pytest.mark.parametrize("run", range(RUNS))
def test_compiled_b1_step_runs_in_a_fresh_process(run):
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "b1_llama.py", "--sides", "meshtron-compile", "--steps", "4", "--warmup", "3",
                           "--", "--num-layers", "4"], cwd=BENCH, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, f"run {run}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "meshtron-compile: failed" not in proc.stdout
