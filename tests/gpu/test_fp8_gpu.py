"""FP8 on the GPU: the Triton cast(+transpose) kernel bit-equal to the reference cast at a block's
shape; each recipe's three ``_scaled_mm`` GEMMs in bf16 against the fp32 simulation of the same
quantized operands, and their distance from the plain GEMMs; the cast kernel's speed. In the
platform's FP8 family (OCP on NVIDIA and gfx950, fnuz on gfx942); skipped where FP8 is refused."""

import pytest
import torch

from meshtron.kernels import fp8, platform
from meshtron.kernels.fp8_cast import fp8_cast
from meshtron.kernels.fp8_scaling import FP8_FAMILIES, FP8_FORMATS, FP8_RECIPES, Fp8Recipe, Fp8Scaling, grad_dtype, platform_family

FAMILY = platform_family() if torch.cuda.is_available() else "ocp"
E4M3, E5M2 = FP8_FAMILIES[FAMILY]
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and platform.fp8_refusal(torch.device("cuda")) is not None, reason="no FP8 on this GPU"
)


def _simulated(t, dtype, dim=None):
    """What the GEMM sees of ``t`` under current scaling (over ``dim``, all of it when None), in fp32."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
    scale = fmax / amax.float().clamp(min=1e-12)
    return (t.float() * scale).to(t.dtype).clamp(-fmax, fmax).to(dtype).float() / scale


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_cast_kernel_gpu(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = (torch.randn(8192, 2048 + 48, device="cuda", generator=gen) * 3).bfloat16()  # a ragged last tile
    fmax, amax = torch.finfo(dtype).max, t.float().abs()
    for scale in (fmax / amax.max(), 4 * fmax / amax.max(), fmax / amax.amax(1, keepdim=True), fmax / amax.amax(0, keepdim=True)):
        fast, ref = (fp8_cast(t, scale, dtype, True, True, True, mode) for mode in ("on", "off"))
        assert torch.equal(fast.rows.view(torch.uint8), ref.rows.view(torch.uint8))
        assert torch.equal(fast.transposed.view(torch.uint8), ref.transposed.view(torch.uint8))
        assert fast.amax.item() == ref.amax.item()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for mode in ("on", "off"):
        fp8_cast(t, scale, dtype, True, True, True, mode)
        start.record()
        for _ in range(20):
            fp8_cast(t, scale, dtype, True, True, True, mode)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 20
        print(f"fp8 cast+transpose+amax {tuple(t.shape)} {dtype} {mode}: {ms:.3f} ms, {4 * t.numel() / ms / 1e6:.0f} GB/s")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [r for r in FP8_RECIPES if r != "blockwise"])  # blockwise: test_fp8_blockwise_gpu.py
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fp8_linear_gpu(recipe, fmt):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(8192, 2048, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    g = torch.randn(4096, 8192, device="cuda", generator=gen).bfloat16()
    y = fp8.linear(x, w, None, Fp8Scaling(Fp8Recipe(fmt, recipe), "cuda"))  # first call: current scaling
    y.backward(g)
    gd = E4M3 if recipe == "rowwise" else grad_dtype(fmt, FAMILY)
    row, col = (1, 0) if recipe == "rowwise" else (None, None)
    xd, wd = x.detach(), w.detach()
    sim = [_simulated(xd, E4M3, row) @ _simulated(wd, E4M3, row).T, _simulated(g, gd, row) @ _simulated(wd, E4M3, col),
           _simulated(g, gd, col).T @ _simulated(xd, E4M3, col)]  # fmt: skip
    exact = [xd.float() @ wd.float().T, g.float() @ wd.float(), g.float().T @ xd.float()]
    for name, got, s, e in zip(("forward", "grad_input", "grad_weight"), (y.detach(), x.grad, w.grad), sim, exact):
        print(f"fp8 {fmt} {recipe} {name}: vs simulation {_rel(got, s):.2e}, vs fp32 GEMM {_rel(got, e):.2e}")
        assert _rel(got, s) < 1e-2 and _rel(got, e) < 0.08
