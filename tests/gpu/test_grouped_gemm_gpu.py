"""The Triton grouped GEMM against the per-expert loop on the GPU, forward and backward: ragged
groups with an empty one, all rows in one group, and DeepSeek-V2-Lite's expert shapes.

Errors are norm-wise relative to the loop run in the same dtype; bf16 differs from the loop only
by the order of fp32 accumulation and one rounding of each output.
"""

import pytest
import torch

from meshtron.kernels.checks import grouped_gemm_checks


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 5e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("large", [False, True])
def test_triton_grouped_gemm_matches_loop_gpu(dtype, tol, large):
    for r in grouped_gemm_checks("cuda", dtype, large=large):
        print(f"{r.name} {dtype} large={large}: forward {r.forward:.2e} backward {r.backward:.2e}")
        assert r.forward < tol and r.backward < tol, r
