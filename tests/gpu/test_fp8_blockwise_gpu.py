"""Blockwise FP8 on the GPU, at the linear shapes of B3 (Llama-3-8B, 8192 tokens): the Triton cast
bit-equal to the reference; each GEMM path (``torch._scaled_mm`` where cuBLAS has block scales,
the Triton kernel) in the three layouts of a linear against float64 GEMMs of the dequantized
operands; the linear's output and gradients against float64; and the speed of each (printed, with
bf16 and per-tensor FP8 GEMMs of the same shapes beside them). Skipped where FP8 is refused."""

import pytest
import torch

from meshtron.kernels import fp8, platform, triton_available
from meshtron.kernels.fp8_blockwise import block_cast, block_mm, dequantize, scaled_mm_takes_blocks
from meshtron.kernels.fp8_scaling import FP8_FAMILIES, Fp8Recipe, Fp8Scaling, platform_family
from meshtron.planning.calibrate import cuda_seconds

E4M3 = FP8_FAMILIES[platform_family() if torch.cuda.is_available() else "ocp"][0]
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and platform.fp8_refusal(torch.device("cuda")) is not None, reason="no FP8 on this GPU"
)
TOKENS = 8192
B3_LINEARS = {"qkv": (6144, 4096), "proj": (4096, 4096), "fc1": (28672, 4096), "fc2": (4096, 14336)}  # (out, in)
# fp8 tensor-core sums keep fewer bits than fp32 (DeepSeek-V3 measured about 14 within a block):
# each result within this fraction of the sum of its terms' magnitudes, on top of bf16's rounding.
TENSOR_CORE_SUMS = 2.0**-12


PATHS = ["scaled_mm", "triton"]


def _skip_unless_available(path: str) -> None:
    if path == "scaled_mm" and not platform.blockwise_scaled_mm(torch.device("cuda")):
        pytest.skip("torch._scaled_mm has no block scales here (cuBLAS's are NVIDIA Hopper's, CUDA 12.9+)")
    if path == "triton" and not triton_available():
        pytest.skip("Triton is not installed")


def _ms(fn) -> float:
    return cuda_seconds(fn) * 1e3


def _rand(*shape, scale=1.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()


@pytest.mark.gpu
def test_block_cast_kernel_gpu():
    t = _rand(TOKENS, 4096, scale=3.0)
    t[:, 5] *= 1000.0  # an outlier channel
    for tile in (False, True):
        fast, ref = (block_cast(t, E4M3, tile, True, True, mode) for mode in ("on", "off"))
        for a, b in zip(fast, ref, strict=True):
            assert a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == E4M3 else torch.equal(a, b)
        for mode in ("on", "off"):
            ms = _ms(lambda: block_cast(t, E4M3, tile, True, True, mode))
            print(f"block cast {'128x128' if tile else '1x128'} rows+transposed {tuple(t.shape)} {mode}: {ms:.3f} ms, "
                  f"{4 * t.numel() / ms / 1e6:.0f} GB/s")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_block_gemms_gpu(path):
    """Forward (x 1x128 by w 128x128), input gradient (g 1x128 by w^T 128x128) and weight gradient
    (g^T by x^T, both 1x128) of each B3 linear against float64, and their speed."""
    _skip_unless_available(path)
    if path == "scaled_mm":  # what training's "auto" asks before it takes cuBLAS's GEMM
        assert scaled_mm_takes_blocks(torch.device("cuda", torch.cuda.current_device()), E4M3)
    for name, (n, k) in B3_LINEARS.items():
        x, w, g = _rand(TOKENS, k, seed=1), _rand(n, k, scale=0.02, seed=2), _rand(TOKENS, n, seed=3)
        xq, wq, gq = (block_cast(t, E4M3, tile, True, True) for t, tile in ((x, False), (w, True), (g, False)))
        gemms = {"forward": (xq.rows, xq.rows_inv, wq.rows, wq.rows_inv), "grad_input": (gq.rows, gq.rows_inv, wq.transposed, wq.transposed_inv),
                 "grad_weight": (gq.transposed, gq.transposed_inv, xq.transposed, xq.transposed_inv)}  # fmt: skip
        for gemm, (a, a_inv, b, b_inv) in gemms.items():
            got = block_mm(a, a_inv, b, b_inv, torch.bfloat16, backend=path)
            da, db = dequantize(a, a_inv).double(), dequantize(b, b_inv).double()
            want, terms = da @ db.t(), da.abs() @ db.abs().t()
            excess = ((got.double() - want).abs() - want.abs() * 2.0**-8) / terms
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[0]
            ms = _ms(lambda: block_mm(a, a_inv, b, b_inv, torch.bfloat16, backend=path))  # noqa: B023
            print(f"blockwise {path} {name} {gemm} {a.shape[0]}x{b.shape[0]}x{a.shape[1]}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, "
                  f"worst error {excess.max().item():.1e} of the terms beyond bf16 rounding")  # fmt: skip
            assert excess.max() <= TENSOR_CORE_SUMS, (name, gemm)
            del da, db, want, terms, excess


@pytest.mark.gpu
def test_reference_gemm_speeds_gpu():
    """The GEMMs blockwise competes with, at the same shapes (printed): bf16, and FP8 per tensor."""
    one = torch.ones((), device="cuda")
    for name, (n, k) in B3_LINEARS.items():
        x, w = _rand(TOKENS, k, seed=1), _rand(n, k, scale=0.02, seed=2)
        x8, w8 = x.to(E4M3), w.to(E4M3)
        flops = 2 * TOKENS * n * k
        for label, fn in (("bf16", lambda: x @ w.t()),  # noqa: B023
                          ("fp8 tensorwise", lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16))):  # noqa: B023  # fmt: skip
            ms = _ms(fn)
            print(f"{label} {name} forward {TOKENS}x{n}x{k}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
        assert torch.isfinite(torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_blockwise_linear_gpu(path, monkeypatch):
    """The linear (cast kernels and ``path``'s GEMMs) against float64 GEMMs of each GEMM's
    operands quantized by the reference, and within a few percent of the unquantized GEMMs."""
    _skip_unless_available(path)
    from meshtron.kernels import fp8_blockwise

    monkeypatch.setattr(fp8_blockwise, "gemm_backend", lambda a, out_dtype, fused_kernels="auto": path)  # what the op's "auto" picks
    x, w, g = _rand(4096, 2048, seed=4).requires_grad_(), _rand(8192, 2048, scale=0.02, seed=5).requires_grad_(), _rand(4096, 8192, seed=6)
    y = fp8.linear(x, w, None, Fp8Scaling(Fp8Recipe("e4m3", "blockwise"), "cuda"))
    y.backward(g)
    xd, wd = x.detach(), w.detach()

    def quantized(t, tile):
        q = block_cast(t.contiguous(), E4M3, tile, fused_kernels="off")
        return dequantize(q.rows, q.rows_inv).double()

    gemms = ((quantized(xd, False), quantized(wd, True)), (quantized(g, False), quantized(wd.t(), True)),
             (quantized(g.t(), False), quantized(xd.t(), False)))  # fmt: skip
    exact = (xd.double() @ wd.double().t(), g.double() @ wd.double(), g.double().t() @ xd.double())
    for name, got, (a, b), e in zip(("forward", "grad_input", "grad_weight"), (y.detach(), x.grad, w.grad), gemms, exact):
        want = a @ b.t()
        excess = ((got.double() - want).abs() - want.abs() * 2.0**-8) / (a.abs() @ b.abs().t())
        rel = ((got.double() - e).norm() / e.norm()).item()
        print(f"blockwise linear {path} {name}: worst error {excess.max().item():.1e} of the terms, vs unquantized {rel:.2e}")
        assert excess.max() <= TENSOR_CORE_SUMS and rel < 0.08
