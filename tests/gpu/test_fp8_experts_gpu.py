"""FP8 experts on the GPU at B4's shapes (DeepSeek-V2-Lite: 64 experts, h 2048, expert FFN 1408, so fc1
2048 -> 2816 and fc2 1408 -> 2048; 49,152 rows ragged over the experts, some empty): the Triton
casts bit-equal to the torch reference; ``torch._scaled_grouped_mm`` (chosen by ``auto`` on sm90)
and the per-expert ``torch._scaled_mm`` loop against float64 GEMMs of the dequantized operands, with
fast accumulation (the forward's) and without (the input gradient's); and the autograd function
(weight gradient fused into an fp32 ``main_grad``) against the reference path. Skipped where FP8
is refused."""

import pytest
import torch

from meshtron.kernels import platform
from meshtron.layers.moe.fp8_grouped_gemm import (
    e4m3,
    fp8_grouped_mm,
    quantize_rows,
    quantize_weights,
    resolve_fp8_backend,
    scaled_grouped_mm,
)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and platform.fp8_refusal(torch.device("cuda")) is not None, reason="no FP8 on this GPU"
)
EXPERTS, ROWS = 64, 49152
LAYERS = {"fc1": (2816, 2048), "fc2": (2048, 1408)}  # (out, in) per expert
# FP8 tensor-core sums keep fewer bits than fp32: each result within this fraction of the sum of
# its terms' magnitudes, on top of bf16's rounding. Exact accumulation promotes partial sums to
# fp32 (as the blockwise GEMMs' test allows); fast accumulation keeps about 14 bits over the whole
# reduction (DeepSeek-V3's measurement), so over 2048 terms its error may reach 2^-9 of the magnitudes.
TENSOR_CORE_SUMS = {False: 2.0**-12, True: 2.0**-9}


def _sizes(device) -> torch.Tensor:
    """Ragged group sizes summing to ROWS, skewed as a router leaves them, with empty experts."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(EXPERTS, generator=gen) + 0.25
    weights[::13] = 0
    sizes = (weights / weights.sum() * ROWS).floor().long()
    sizes[1] += ROWS - sizes.sum()
    return sizes.to(device)


def _operands(out_features: int, in_features: int):
    gen = torch.Generator(device="cuda").manual_seed(out_features)
    x = torch.randn(ROWS, in_features, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(EXPERTS, out_features, in_features, device="cuda", generator=gen) * in_features**-0.5).bfloat16()
    return x, w


def _grouped64(a: torch.Tensor, b: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows @ b[g].t() for g, rows in enumerate(torch.split(a, sizes.tolist()))])


@pytest.mark.gpu
@pytest.mark.parametrize("layer", list(LAYERS))
def test_casts_are_bit_equal_to_the_reference_gpu(layer):
    x, w = _operands(*LAYERS[layer])
    dtype = e4m3(x.device)
    kernel, reference = quantize_weights(w, dtype, True, True, "on"), quantize_weights(w, dtype, True, True, "off")
    for got, want in zip(kernel, reference):
        assert torch.equal(got.view(torch.uint8) if got.dtype == dtype else got, want.view(torch.uint8) if want.dtype == dtype else want)
    (q, inv), (q_ref, inv_ref) = quantize_rows(x, dtype, "on"), quantize_rows(x, dtype, "off")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(inv, inv_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("backend", ["scaled", "loop"])
@pytest.mark.parametrize("fast_accum", [True, False])
def test_fp8_grouped_gemm_matches_float64_gpu(layer, backend, fast_accum):
    x, w = _operands(*LAYERS[layer])
    sizes, dtype = _sizes(x.device), e4m3(x.device)
    if backend == "scaled":
        assert resolve_fp8_backend(x, "auto") == "scaled", "auto should take torch._scaled_grouped_mm on this GPU"
    xq, x_inv = quantize_rows(x, dtype)
    wq = quantize_weights(w, dtype, True, False)
    got = scaled_grouped_mm(xq, x_inv, wq.rows, wq.rows_inv, sizes, backend, torch.bfloat16, fast_accum).double()
    a, b = xq.double() * x_inv[:, None].double(), wq.rows.double() * wq.rows_inv[:, :, None].double()
    want, magnitude = _grouped64(a, b, sizes), _grouped64(a.abs(), b.abs(), sizes)
    excess = ((got - want).abs() - (2.0**-8 * want.abs() + TENSOR_CORE_SUMS[fast_accum] * magnitude)).max().item()
    exact = _grouped64(x.double(), w.double(), sizes)
    rel = ((got - exact).norm() / exact.norm()).item()
    print(f"{layer} {backend} fast_accum={fast_accum}: bound excess {excess:.2e}, against the unquantized product {rel:.2e}")
    assert excess <= 0 and rel < 0.06


@pytest.mark.gpu
@pytest.mark.parametrize("layer", list(LAYERS))
def test_fp8_experts_autograd_against_reference_gpu(layer):
    """``fp8_grouped_mm`` on ``auto`` against the reference path: output and input gradient differ
    only by the GEMMs' accumulation and bf16 rounding; the weight gradient (fused into fp32
    ``main_grad`` by the Triton kernel) equals the per-expert fp32 product of the bf16 operands."""
    from meshtron.optim.grad_buffer import GradBuffer

    x, w = _operands(*LAYERS[layer])
    sizes = _sizes(x.device)
    grad = torch.randn(ROWS, w.shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()
    results = {}
    for backend in ("auto", "reference"):
        weight = torch.nn.Parameter(w.clone())
        buffer = GradBuffer([("experts.weight1", weight)])
        xi = x.clone().requires_grad_(True)
        out = fp8_grouped_mm(xi, weight, sizes, backend, fuse_wgrad=True)
        out.backward(grad)
        buffer.finish_grad_sync()
        assert weight.grad is None
        results[backend] = (out.double(), xi.grad.double(), weight.main_grad.double())
    (out, dx, dw), (out_ref, dx_ref, dw_ref) = results["auto"], results["reference"]
    ends = torch.cumsum(sizes, 0).tolist()
    exact_dw = torch.stack([grad[lo:hi].double().t() @ x[lo:hi].double() for lo, hi in zip([0] + ends[:-1], ends)])
    errors = {"out": (out - out_ref).norm() / out_ref.norm(), "dx": (dx - dx_ref).norm() / dx_ref.norm(),
              "dw": (dw - exact_dw).norm() / exact_dw.norm()}  # fmt: skip
    print(f"{layer}: " + ", ".join(f"{k} {v.item():.2e}" for k, v in errors.items()))
    assert errors["out"] < 5e-3 and errors["dx"] < 5e-3 and errors["dw"] < 1e-5
