"""The fp32 router gate of bf16 operands (``kernels/fp32_gate.py``): the three-way bf16 split of an
fp32 gradient is exact to fp32's precision; the gate's logits equal the plain path's (cast both to
fp32, multiply in fp32) and its gradients do but for bf16 rounding edges. On the CPU the bf16 GEMMs are
emulated exactly in fp32; ``tests/gpu/test_moe_router_gpu.py`` runs them on tensor cores."""

import os

import pytest
import torch

from meshtron.kernels import triton_available
from meshtron.kernels.fp32_gate import Fp32Gate, fp32_gate, split_in_three

if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel split's test, as test_kernels_triton.py


def test_three_bf16_pieces_hold_an_fp32_value():
    g = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 3, 48)
    pieces = split_in_three(g).float().view(64, 3, 48).sum(1)
    assert ((pieces - g).abs() <= g.abs() * 2**-23).all()
    assert ((split_in_three(g)[:, :48].float() - g).abs() > g.abs() * 2**-20).any()  # one piece would not


def _plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), w.float())


def test_gate_equals_the_fp32_path():
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(96, 32, generator=gen).bfloat16()
    w0 = (torch.randn(8, 32, generator=gen) * 0.1).bfloat16()
    upstream = torch.randn(96, 8, generator=gen)
    results = []
    for fn in (Fp32Gate.apply, _plain):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        logits = fn(x, w)
        logits.backward(upstream)
        results.append((logits, x.grad, w.grad))
    (fast, dx, dw), (ref, ref_dx, ref_dw) = results
    assert fast.dtype == torch.float32 and dx.dtype == dw.dtype == torch.bfloat16
    assert torch.equal(fast, ref)  # the forward is the fp32 path's own GEMM
    # Both round an fp32 result to bf16 once: equal but where the fp32 sums straddle a rounding edge.
    assert (dx.float() - ref_dx.float()).abs().max() <= ref_dx.float().abs().max() * 2**-8
    assert (dx != ref_dx).float().mean() < 0.01 and (dw != ref_dw).float().mean() < 0.01


def test_other_dtypes_take_the_plain_path():
    x, w = torch.randn(4, 6), torch.randn(3, 6)
    assert torch.equal(fp32_gate(x, w), _plain(x, w))


def test_the_kernel_split_holds_the_same_fp32_value():
    """The Triton split (under the interpreter, which truncates where a GPU rounds: each piece then
    holds the next 8 bits exactly), summed back, is the fp32 gradient; the gate's gradients with
    it equal the reference split's but for bf16 rounding edges. ``tests/gpu`` holds it to the
    reference bit for bit."""
    import os

    import pytest

    from meshtron.kernels import triton_available

    if not triton_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    from meshtron.kernels.triton_pointwise import split_in_three as kernel_split

    g = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 3, 48)
    assert ((kernel_split(g).float().view(64, 3, 48).sum(1) - g).abs() <= g.abs() * 2**-23).all()
    gen = torch.Generator().manual_seed(1)
    x0, w0 = torch.randn(96, 32, generator=gen).bfloat16(), (torch.randn(8, 32, generator=gen) * 0.1).bfloat16()
    grads = []
    for mode in ("on", "off"):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fp32_gate(x, w, mode).backward(torch.randn(96, 8, generator=torch.Generator().manual_seed(2)))
        grads.append((x.grad.float(), w.grad.float()))
    for got, want in zip(*grads):
        assert (got - want).abs().max() <= want.abs().max() * 2**-7
