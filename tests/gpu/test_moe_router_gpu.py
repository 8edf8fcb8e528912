"""The fused router kernel against its reference on the GPU (``meshtron.kernels.checks.router_checks``):
DeepSeek-V2-Lite's, Mixtral's and a DeepSeek-V3-like router at 8192 tokens in fp32 (no tied logits,
so both sides choose the same experts), the small cases in bf16."""

import pytest
import torch

from meshtron.kernels.checks import router_checks


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,large,tol", [(torch.float32, True, 1e-5), (torch.bfloat16, False, 1e-2)])
def test_fused_router_matches_reference_gpu(dtype, large, tol):
    for r in router_checks("cuda", dtype, large=large):
        print(f"{r.name} {dtype}: forward {r.forward:.2e} backward {r.backward:.2e}")
        assert r.forward < tol and r.backward < tol, r
