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


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_expert_weight_gradient_gpu(backend):
    """Gradient-accumulation fusion for the experts at DeepSeek-V2-Lite's fc2 shape (64 experts,
    1408 -> 2048, bf16, ragged groups with empty ones), the buffer holding stale NaN: two micro
    batches land in ``main_grad`` as the fp32 sum of the per-expert products (written, then added
    by the autotuned Triton weight-gradient kernel)."""
    from meshtron.layers.moe.grouped_gemm import grouped_mm
    from meshtron.optim.grad_buffer import GradBuffer

    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = torch.randint(0, 160, (64,), generator=gen, device="cuda")
    sizes[::9] = 0
    rows = int(sizes.sum())
    weight = torch.nn.Parameter(torch.randn(64, 2048, 1408, device="cuda", generator=gen).bfloat16() * 0.02)
    buffer = GradBuffer([("experts.weight2", weight)])
    buffer.data.fill_(float("nan"))
    exact = torch.zeros(64, 2048, 1408, device="cuda")
    ends = torch.cumsum(sizes, 0).tolist()
    for _ in range(2):
        x = torch.randn(rows, 1408, device="cuda", generator=gen).bfloat16().requires_grad_()
        g = torch.randn(rows, 2048, device="cuda", generator=gen).bfloat16()
        grouped_mm(x, weight, sizes, backend, fuse_wgrad=True).backward(g)
        for e, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
            exact[e] += g[lo:hi].float().t() @ x[lo:hi].float()
    buffer.finish_grad_sync()
    rel = ((weight.main_grad - exact).norm() / exact.norm()).item()
    print(f"fused expert wgrad ({backend}): relative error {rel:.2e}")
    assert weight.grad is None and rel < 1e-5
