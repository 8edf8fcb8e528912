"""``benchmarks/host_profile.py``: one block's aten ops, host time and Python hot spots, forward and
backward, and its bit-for-bit comparison of two trees' outputs and gradients."""

import collections
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


def test_full_recompute_reruns_a_recorded_forward_in_backward():
    """Under a non-reentrant checkpoint (full recompute) the forward dispatches the plain forward's
    ops (the graph is still recorded; only the saved tensors are dropped) and the backward reruns
    them before its own (up to the last one that saves a tensor), with a detach per tensor it
    saves again: the host pays one more forward, not a cheaper one."""
    sys.path.insert(0, str(BENCHMARKS))
    from host_profile import build, counted

    def no_detach(counts):
        return {op: n for op, n in counts.items() if op != "aten.detach"}

    (_, plain), (_, rerun) = (build("llama", "cpu", 16, "small", [], recompute=r) for r in (False, True))
    plain_fwd, plain_bwd = counted(plain)
    fwd, bwd = counted(rerun)
    assert no_detach(fwd) == no_detach(plain_fwd)
    both = collections.Counter(no_detach(plain_fwd + plain_bwd))
    assert not collections.Counter(no_detach(bwd)) - both
    assert sum((both - collections.Counter(no_detach(bwd))).values()) <= 2  # the rerun stops after its last saved tensor
    assert bwd["aten.detach"] > plain_bwd["aten.detach"] + plain_fwd["aten.detach"]
