"""``meshtron plan --calibrate`` on this machine: under a minute, a file the planner reads, rates
that make sense (GEMMs faster at larger sizes and below the datasheet peak)."""

import subprocess
import sys
import time

import pytest

from meshtron.planning.hardware import load


@pytest.mark.gpu
def test_calibrate_is_quick_and_readable(tmp_path):
    path = tmp_path / "cal.json"
    began = time.time()
    subprocess.run([sys.executable, "-m", "meshtron", "plan", "--calibrate", "--calibration-out", str(path), "--model.preset",
                    "llama3-8b", "--num-layers", "2", "--seq-length", "8192"], check=True)  # fmt: skip
    assert time.time() - began < 60
    machine = load(str(path))
    rates = [t for _, t in machine.gemm_tflops]
    assert rates[-1] > rates[0] and max(rates) < machine.peak_tflops
    assert all(t > 0 for _, t in machine.attention_tflops) and machine.hbm_gbps > 500


@pytest.mark.gpu
def test_calibrate_measures_the_grouped_expert_gemms(tmp_path):
    path = tmp_path / "cal.json"
    subprocess.run([sys.executable, "-m", "meshtron", "plan", "--calibrate", "--calibration-out", str(path), "--model.preset",
                    "deepseek-v2-lite", "--num-layers", "2", "--seq-length", "4096"], check=True)  # fmt: skip
    machine = load(str(path))
    assert "measured" in machine.sources["grouped_gemm_factor"]
    assert 0.2 < machine.grouped_gemm_factor < 1.5  # a share of dense speed, not a unit slip
    rows = [r for r, _ in machine.grouped_gemm_curve]
    assert len(rows) == 4 and rows == sorted(rows) and all(0.2 < f < 1.5 for _, f in machine.grouped_gemm_curve)
    assert machine.grouped_gemm_curve[0][1] == machine.grouped_gemm_factor
    # the host's launches per block, plain and under full recompute (which reruns the forward's)
    assert set(machine.host_ms_per_block) == set(machine.host_ms_per_block_recompute) == {"dense", "moe"}
    assert all(machine.host_ms_per_block_recompute[k] > machine.host_ms_per_block[k] > 0 for k in ("dense", "moe"))
