"""The FP8 linear's three ``_scaled_mm`` GEMMs on the GPU against the fp32 simulation of the same
quantized operands, in bf16 at a block's shapes; and its distance from the plain bf16 GEMMs."""

import pytest
import torch

from meshtron.kernels import fp8


def _dequantize(q: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of ``fp8.quantize``: what the quantized tensor stands for."""
    return (q.float() * inv_scale).to(dtype)


def _simulated(t, dtype):
    return _dequantize(*fp8.quantize(t, dtype))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
def test_fp8_linear_gpu(fmt):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(8192, 2048, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    g = torch.randn(4096, 8192, device="cuda", generator=gen).bfloat16()
    y = fp8.linear(x, w, None, fmt)
    y.backward(g)
    gd = fp8.grad_dtype(fmt)
    xs, ws, gs = _simulated(x.detach(), fp8.E4M3), _simulated(w.detach(), fp8.E4M3), _simulated(g, gd)
    sim = [xs @ ws.T, gs @ ws, gs.T @ xs]
    exact = [x.detach().float() @ w.detach().float().T, g.float() @ w.detach().float(), g.float().T @ x.detach().float()]
    for name, got, s, e in zip(("forward", "grad_input", "grad_weight"), (y.detach(), x.grad, w.grad), sim, exact):
        print(f"fp8 {fmt} {name}: vs simulation {_rel(got, s):.2e}, vs fp32 GEMM {_rel(got, e):.2e}")
        assert _rel(got, s) < 1e-2 and _rel(got, e) < 0.08
