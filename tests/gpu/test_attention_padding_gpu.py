"""The flash backend with value heads narrower than query/key heads (MLA's 192 / 128): v is padded
to the qk dim for the kernel and the extra output columns dropped; the result and the gradients
equal cuDNN's, which takes the unequal dims as they are."""

import pytest
import torch

from meshtron.layers.attention import CoreAttention


@pytest.mark.gpu
def test_flash_pads_narrow_values_to_the_qk_dim():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(2, 4, 256, 192, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    results = {}
    for backend in ("flash", "cudnn"):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = CoreAttention(backend, scale=0.1)(*inputs, None, 0.0)
        out.float().square().sum().backward()
        results[backend] = (out, *(t.grad for t in inputs))
    assert results["flash"][0].shape == (2, 4, 256, 128)
    for got, want in zip(results["flash"], results["cudnn"]):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
