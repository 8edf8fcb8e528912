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


@pytest.mark.gpu
def test_fp32_gate_on_tensor_cores_gpu():
    """The fp32 router gate of bf16 operands (``kernels/fp32_gate.py``) at DeepSeek-V2-Lite's shape
    (8192 tokens, hidden 2048, 64 experts): the logits are the plain path's, both gradients (its
    backward on tensor cores) as close to the fp64 result as the plain path's fp32 GEMMs; the two timed."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from meshtron.kernels.fp32_gate import Fp32Gate

    gen = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(8192, 2048, device="cuda", generator=gen).bfloat16()
    w0 = (torch.randn(64, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
    upstream = torch.randn(8192, 64, device="cuda", generator=gen)

    def plain(x, w):
        return torch.nn.functional.linear(x.float(), w.float())

    def run(fn, dtype=None):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        if dtype is not None:  # the fp64 reference
            x, w = x0.to(dtype).requires_grad_(), w0.to(dtype).requires_grad_()
        logits = fn(x, w)
        logits.backward(upstream.to(logits.dtype))
        return logits.double(), x.grad.double(), w.grad.double()

    reference = run(lambda x, w: x @ w.t(), torch.float64)
    errors = {}
    for name, fn in (("tensor cores", Fp32Gate.apply), ("fp32", plain)):
        errors[name] = [((got - ref).norm() / ref.norm()).item() for got, ref in zip(run(fn), reference)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            run(fn)
        end.record()
        torch.cuda.synchronize()
        print(f"fp32 gate, {name}: fwd+bwd {start.elapsed_time(end) / 10:.3f} ms, errors (logits, dx, dW) {errors[name]}")
    from meshtron.kernels import triton_pointwise
    from meshtron.kernels.fp32_gate import split_in_three

    assert torch.equal(triton_pointwise.split_in_three(upstream), split_in_three(upstream))  # the kernel's split is the reference's
    assert errors["tensor cores"][0] == errors["fp32"][0]
    for fast, slow in zip(errors["tensor cores"][1:], errors["fp32"][1:]):
        assert fast <= 1.001 * slow
