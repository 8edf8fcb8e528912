"""The Triton grouped GEMM against the per-expert loop on the CPU, through Triton's interpreter (fp32).

Skipped where Triton is not installed and where a GPU is present (tests/gpu/test_grouped_gemm_gpu.py
runs it compiled): the interpreter is switched on by an environment variable read when the kernels
are first defined, as in test_kernels_triton.py.
"""

import contextlib
import os

import pytest
import torch

from meshtron.kernels import triton_available

pytestmark = pytest.mark.skipif(
    not triton_available() or torch.cuda.is_available(), reason="needs Triton, and no GPU (then tests/gpu covers it)"
)
if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from meshtron.kernels.checks import grouped_gemm_checks  # noqa: E402
from meshtron.layers.moe.grouped_gemm import grouped_mm  # noqa: E402


def test_triton_grouped_gemm_matches_loop_fp32():
    results = grouped_gemm_checks("cpu", torch.float32)
    assert len(results) == 3
    for r in results:
        assert r.forward < 1e-5 and r.backward < 1e-5, r


def test_triton_grouped_gemm_gives_empty_experts_zero_weight_grad():
    x = torch.randn(7, 16)
    weight = torch.randn(3, 8, 16, requires_grad=True)
    out = grouped_mm(x, weight, torch.tensor([4, 0, 3]), "triton")
    out.sum().backward()  # an expanded (stride-0) upstream gradient
    assert torch.equal(weight.grad[1], torch.zeros(8, 16))
    torch.testing.assert_close(weight.grad[0], torch.ones(8, 4) @ x[:4], rtol=1e-5, atol=1e-5)


def test_moe_layer_with_triton_experts_equals_loop():
    """``--model.moe_grouped_gemm triton`` through the MoE layer: output and every gradient as with the loop."""
    from meshtron.config import ModelConfig
    from meshtron.layers.moe import MoELayer

    outputs, grads = [], []
    for backend in ("loop", "triton"):
        torch.manual_seed(0)
        cfg = ModelConfig(num_layers=2, hidden_size=20, num_experts=5, moe_router_topk=2, moe_ffn_hidden_size=12,
                          add_bias_linear=False, activation="swiglu", moe_grouped_gemm=backend, moe_aux_loss_coeff=0.01)  # fmt: skip
        layer = MoELayer(cfg).train()
        x = torch.randn(3, 7, 20, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = layer(x)
        (y.square().sum() + layer.last_aux_losses["load_balancing"]).backward()
        outputs.append(y)
        grads.append([x.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-6, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_triton_grouped_gemm_with_no_rows():
    weight = torch.randn(3, 8, 16, requires_grad=True)
    out = grouped_mm(torch.zeros(0, 16), weight, torch.zeros(3, dtype=torch.long), "triton")
    assert out.shape == (0, 8)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros(3, 8, 16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_weight_gradient_lands_in_main_grad(backend):
    """Gradient-accumulation fusion for the experts: fp16 weights (bf16 on the GPU, which
    Triton's interpreter cannot multiply), two micro batches, an empty group, the buffer holding
    stale NaN at the step's start. The fused Triton weight gradient is written, then added, in
    fp32 into ``main_grad`` (exact sums of fp16 products, no fp16 tensor made); the hook's path
    rounds each micro batch's gradient to fp16 first. Input gradients equal."""
    from meshtron.optim.grad_buffer import GradBuffer

    sizes = torch.tensor([5, 0, 6])
    xs = [torch.randn(11, 16, generator=torch.Generator().manual_seed(i)).half() for i in range(2)]
    gs = [torch.randn(11, 8, generator=torch.Generator().manual_seed(5 + i)).half() for i in range(2)]
    exact = torch.zeros(3, 8, 16, dtype=torch.float64)
    for x, g in zip(xs, gs):
        exact[0] += g[:5].double().t() @ x[:5].double()
        exact[2] += g[5:].double().t() @ x[5:].double()
    results = {}
    for fuse in (False, True):
        weight = torch.nn.Parameter(torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(9)).half())
        buffer = GradBuffer([("experts.weight1", weight)])
        buffer.data.fill_(float("nan"))
        input_grads = []
        for x, g in zip(xs, gs):
            x = x.clone().requires_grad_()
            grouped_mm(x, weight, sizes, backend, fuse_wgrad=fuse).backward(g)
            input_grads.append(x.grad)
        buffer.finish_grad_sync()
        assert weight.grad is None
        results[fuse] = weight.main_grad.double(), input_grads
    rel = {fuse: ((grad - exact).norm() / exact.norm()).item() for fuse, (grad, _) in results.items()}
    assert rel[True] < 1e-6 < 1e-5 < rel[False] < 1e-3, rel
    for fused, plain in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def test_fused_weight_gradient_deferred_to_a_split_backwards_w():
    """Inside a zero-bubble schedule's input-gradient pass (``WeightGradStore.record``) the fused
    experts' weight gradient waits: ``main_grad`` keeps its stale NaN (not yet written this step)
    while the input gradient is there (bitwise the fused backward's); ``run``, here for the micro
    batches in reverse order, then lands what the fused backward writes (to fp32 rounding)."""
    from meshtron.kernels.deferred_wgrad import WeightGradStore
    from meshtron.optim.grad_buffer import GradBuffer

    sizes = torch.tensor([5, 0, 6])
    xs = [torch.randn(11, 16, generator=torch.Generator().manual_seed(i)).half() for i in range(2)]
    gs = [torch.randn(11, 8, generator=torch.Generator().manual_seed(5 + i)).half() for i in range(2)]
    results = {}
    for split in (False, True):
        weight = torch.nn.Parameter(torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(9)).half())
        buffer = GradBuffer([("experts.weight1", weight)])
        buffer.data.fill_(float("nan"))
        store, input_grads = WeightGradStore(), []
        for i, (x, g) in enumerate(zip(xs, gs)):
            x = x.clone().requires_grad_()
            with store.record(i) if split else contextlib.nullcontext():
                grouped_mm(x, weight, sizes, "triton", fuse_wgrad=True).backward(g)
            input_grads.append(x.grad)
        if split:
            assert torch.isnan(weight.main_grad).all() and len(store.pending) == 2
            store.run(1)
            store.run(0)
        buffer.finish_grad_sync()
        results[split] = weight.main_grad.clone(), input_grads
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-6, atol=0)
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
