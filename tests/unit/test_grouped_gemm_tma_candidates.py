"""``benchmarks/grouped_gemm_tma.py``, the TMA grouped-GEMM candidates, against the per-group
products on the CPU through Triton's interpreter (fp32): ragged, empty and straddled groups, tiles
reaching past a group's end and past the widths, more tiles than programs.

The GPU sweep (``b4_grouped_sweep.py --candidates``) checks them again compiled, in bf16, before it
times them.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from meshtron.kernels import triton_available

pytestmark = pytest.mark.skipif(
    not triton_available() or torch.cuda.is_available(), reason="needs Triton, and no GPU (the sweep covers it there)"
)
if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import grouped_gemm_tma as tma  # noqa: E402

    from meshtron.kernels.triton_grouped_gemm import group_offsets  # noqa: E402

TILE = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
SIZES = [[5, 0, 17, 9], [0, 0, 33, 1], [0, 0, 0, 0]]


def _groups(sizes):
    bounds = torch.cumsum(torch.tensor([0, *sizes]), 0).tolist()
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("sizes", SIZES)
def test_row_kernels_match_per_group_products(sizes):
    torch.manual_seed(0)
    tma.ensure_allocator()
    n, k = 20, 24  # 20 columns: the second column tile straddles into the next expert's weight rows
    x, weight = torch.randn(sum(sizes), k), torch.randn(len(sizes), n, k)
    dy = torch.randn(sum(sizes), n)
    offsets = group_offsets(torch.tensor(sizes))
    out = tma.rows_times_group_tma(x, weight, offsets, True, TILE, num_programs=3)
    dx = tma.rows_times_group_tma(dy, weight, offsets, False, TILE, num_programs=3)
    for g, rows in enumerate(_groups(sizes)):
        torch.testing.assert_close(out[rows], x[rows] @ weight[g].t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx[rows], dy[rows] @ weight[g], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_weight_gradient_matches_per_group_products(sizes, accumulate):
    torch.manual_seed(0)
    tma.ensure_allocator()
    n, k = 20, 24
    dy, x = torch.randn(sum(sizes), n), torch.randn(sum(sizes), k)
    start = torch.randn(len(sizes), n, k)
    dw = tma.group_weight_grad_tma(dy, x, group_offsets(torch.tensor(sizes)), start.clone(), accumulate, TILE, num_programs=5)
    for g, rows in enumerate(_groups(sizes)):
        expected = dy[rows].t() @ x[rows] + (start[g] if accumulate else 0)
        torch.testing.assert_close(dw[g], expected, rtol=1e-5, atol=1e-5)


def test_unaligned_widths_are_refused():
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        tma.rows_times_group_tma(torch.randn(4, 6), torch.randn(2, 8, 6), group_offsets(torch.tensor([2, 2])), True, TILE, 2)
