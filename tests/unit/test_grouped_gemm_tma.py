"""The grouped GEMM's persistent TMA row kernel (forward and input gradient on Hopper) against the
per-group products on the CPU through Triton's interpreter (fp32): ragged, empty and straddled
groups, tiles reaching past a group's end and past the widths, more tiles than programs, the
store in one piece and in two halves.

tests/gpu/test_grouped_gemm_gpu.py runs it compiled, in bf16 and fp16, at B4's shapes.
"""

import os

import pytest
import torch

from meshtron.kernels import triton_available

pytestmark = pytest.mark.skipif(
    not triton_available() or torch.cuda.is_available(), reason="needs Triton, and no GPU (then tests/gpu covers it)"
)
if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from meshtron.kernels.triton_grouped_gemm import group_offsets, rows_times_group_tma, tma_rows_usable  # noqa: E402


def _tile(split_store: bool) -> dict:
    return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, FLATTEN=False, SPLIT_STORE=split_store)


@pytest.mark.parametrize("sizes", [[5, 0, 17, 9], [0, 0, 33, 1], [0, 0, 0, 0]])
@pytest.mark.parametrize("split_store", [False, True])
def test_tma_row_kernel_matches_per_group_products(sizes, split_store):
    torch.manual_seed(0)
    n, k = 20, 24  # 20 columns: the second column tile straddles into the next expert's weight rows
    x, weight, dy = torch.randn(sum(sizes), k), torch.randn(len(sizes), n, k), torch.randn(sum(sizes), n)
    offsets = group_offsets(torch.tensor(sizes))
    out = rows_times_group_tma(x, weight.transpose(1, 2), offsets, 3, _tile(split_store))  # the forward: W read transposed
    dx = rows_times_group_tma(dy, weight, offsets, 3, _tile(split_store))  # the input gradient: W as stored
    bounds = torch.cumsum(torch.tensor([0, *sizes]), 0).tolist()
    for g, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        torch.testing.assert_close(out[lo:hi], x[lo:hi] @ weight[g].t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx[lo:hi], dy[lo:hi] @ weight[g], rtol=1e-5, atol=1e-5)


def test_tma_kernel_is_not_chosen_off_a_gpu():
    assert not tma_rows_usable(torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(2, 16, 16, dtype=torch.bfloat16))

