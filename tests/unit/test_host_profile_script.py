"""``benchmarks/host_profile.py``: one block's aten ops, host time and Python hot spots, forward and
backward, and its bit-for-bit comparison of two trees' outputs and gradients."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow  # three script runs, ~35 s on 2 busy cores; a benchmark's check, run on the GPU too
def test_moe_block_is_counted_timed_and_dumped_and_dumps_compare_bit_for_bit(tmp_path):
    run = [sys.executable, "host_profile.py", "--kinds", "moe", "--repeat", "2", "--top", "3", "--dump", str(tmp_path / "d")]
    out = subprocess.run(run, cwd=BENCHMARKS, capture_output=True, text=True, check=True).stdout
    fwd_ops, bwd_ops = map(int, re.search(r"== moe: fwd_ops (\d+), bwd_ops (\d+)", out).groups())
    assert fwd_ops > 100 and bwd_ops > 100  # router, dispatch, 64 experts' grouped GEMMs, combine, MLA
    assert "forward, Python by own time" in out and "backward, Python by own time" in out
    assert re.search(r"\| moe \| \d+ \| \d+ \| \d+ \| \d+ \|", out)
    dump = str(tmp_path / "d.moe.pt")
    same = subprocess.run([sys.executable, "host_profile.py", "--compare", dump, dump], cwd=BENCHMARKS, capture_output=True, text=True)
    assert same.returncode == 0 and "bit-equal" in same.stdout
    tensors = torch.load(dump)
    tensors["grad/input"][0, 0, 0] += 1e-6
    torch.save(tensors, tmp_path / "changed.pt")
    differs = subprocess.run([sys.executable, "host_profile.py", "--compare", dump, str(tmp_path / "changed.pt")], cwd=BENCHMARKS,
                             capture_output=True, text=True)  # fmt: skip
    assert differs.returncode == 1 and "differs: grad/input" in differs.stdout
