"""The flash backend with value heads narrower than query/key heads (MLA's 192 / 128): v is padded
to the qk dim for the kernel and the extra output columns dropped; the result and the gradients
equal an fp32 reference's to bf16 precision (norm-relative), as cuDNN's, which takes the unequal
dims as they are, does; ``auto`` is one of them (cuDNN on NVIDIA, padded flash on ROCm, which has no cuDNN)."""

import pytest
import torch
import torch.nn.functional as F

from meshtron.kernels import platform
from meshtron.layers.attention import CoreAttention

TOL = 2e-2  # bf16 kernels against fp32, relative as a norm over each tensor


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "auto"] + (["cudnn"] if platform.cudnn_attention() else []))
def test_narrow_values_against_fp32(backend):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(2, 4, 256, 192, device="cuda", generator=g).bfloat16() for _ in range(2))
    v = torch.randn(2, 4, 256, 128, device="cuda", generator=g).bfloat16()
    dout = torch.randn(2, 4, 256, 128, device="cuda", generator=g).bfloat16()
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = CoreAttention(backend, scale=0.1)(*inputs, None, 0.0)
    got = (out, *torch.autograd.grad(out, inputs, dout))
    ref_inputs = [t.float().requires_grad_() for t in (q, k, v)]
    want_out = F.scaled_dot_product_attention(*ref_inputs, is_causal=True, scale=0.1)
    want = (want_out, *torch.autograd.grad(want_out, ref_inputs, dout.float()))
    assert got[0].shape == (2, 4, 256, 128)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(a, b) < TOL, f"{backend}: {name} relative error {_rel(a, b):.2e}"
