"""The Triton kernels against their references on the GPU, in the dtypes training runs in."""

import pytest
import torch

from meshtron.kernels.checks import run_checks


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("large", [False, True])
def test_kernels_match_references_gpu(dtype, tol, large):
    for r in run_checks("cuda", dtype, large=large):
        print(f"{r.name} {dtype} large={large}: forward {r.forward:.2e} backward {r.backward:.2e}")
        assert r.forward < tol and r.backward < tol, r
