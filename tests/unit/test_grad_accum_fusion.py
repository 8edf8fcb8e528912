"""Gradient-accumulation fusion on the CPU: the fused linear's weight gradients land in
``main_grad`` equal (fp32) or closer to exact (bf16) than the hook's path, over several micro
batches, with no weight gradient materialized; the layer swap; the flag and its refusal with
--compile. Bucket readiness under data parallelism is tested in tests/distributed."""

import os

import pytest
import torch
from torch import nn

from meshtron.config import build_config
from meshtron.validation import validate
from meshtron.kernels import cross_entropy_sum, triton_available
from meshtron.kernels.grad_accum_fusion import FusedWgradLinear, apply_gradient_accumulation_fusion
from meshtron.layers.output import OutputLayer
from meshtron.models import build_model
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

MICRO_BATCHES = 3
if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # fused_kernels "on" runs the interpreter on the CPU


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 8, bias=False)).to(dtype)


def _accumulated(model: nn.Module) -> GradBuffer:
    """The buffer after ``MICRO_BATCHES`` backward passes of fixed inputs."""
    buffer = GradBuffer(list(model.named_parameters()))
    dtype = next(model.parameters()).dtype
    for i in range(MICRO_BATCHES):
        x = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(i)).to(dtype)
        model(x).float().square().sum().backward()
    return buffer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fp32_main_grad_matches_the_hook_path():
    plain = _accumulated(_mlp(torch.float32))
    model = _mlp(torch.float32)
    apply_gradient_accumulation_fusion(model)
    fused = _accumulated(model)
    torch.testing.assert_close(fused.data, plain.data, rtol=1e-6, atol=1e-6)


def test_bf16_weight_gradients_accumulate_in_fp32():
    """One bf16 linear, output gradients given exactly: the fused weight gradient is the fp32 sum
    of exact products, while the hook's path rounds each micro batch's product to bf16 first."""
    xs = [torch.randn(64, 24, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(MICRO_BATCHES)]
    gs = [torch.randn(64, 40, generator=torch.Generator().manual_seed(9 + i)).bfloat16() for i in range(MICRO_BATCHES)]
    exact = sum(g.double().t() @ x.double() for g, x in zip(gs, xs))
    grads = {}
    for fuse in (False, True):
        layer = nn.Linear(24, 40, bias=False).bfloat16()
        if fuse:
            layer.__class__ = FusedWgradLinear
        GradBuffer([("weight", layer.weight)])
        for x, g in zip(xs, gs):
            layer(x).backward(g)
        assert layer.weight.grad is None  # bf16 gradients freed (hook) or never made (fused)
        grads[fuse] = layer.weight.main_grad.double()
    assert _rel(grads[True], exact) < 1e-6 < 1e-4 < _rel(grads[False], exact)


@pytest.mark.parametrize("fuse", [False, True], ids=["hook", "fused"])
def test_a_step_never_reads_the_last_steps_gradients(fuse):
    """The buffer is not cleared between steps (bf16 params: the first gradient of a step is
    written, not added). Stale values, here NaN, must not reach the step's gradients: the used
    params get exactly this step's micro-batch sum, the unused one zeros after finish_grad_sync;
    an fp32 param (autograd adds into its view in place) is cleared at the step's start."""
    torch.manual_seed(0)
    used, unused = nn.Linear(24, 40, bias=False).bfloat16(), nn.Linear(24, 40, bias=False).bfloat16()
    scale = nn.Parameter(torch.ones(40))  # fp32
    if fuse:
        used.__class__ = unused.__class__ = FusedWgradLinear
    buffer = GradBuffer([("used", used.weight), ("unused", unused.weight), ("scale", scale)])
    xs = [torch.randn(16, 24, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(MICRO_BATCHES)]

    def backward_all():
        for x in xs:
            (used(x).float() * scale).square().sum().backward()

    backward_all()
    buffer.finish_grad_sync()
    expected = used.weight.main_grad.clone(), scale.grad.clone()
    buffer.zero_()
    buffer.data.fill_(float("nan"))  # what an earlier step left, as far as the new one may know
    scale.grad.zero_()  # ... except in fp32 views, which zero_() clears (emulated after the fill)
    backward_all()
    buffer.finish_grad_sync()
    torch.testing.assert_close(used.weight.main_grad, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(scale.grad, expected[1], rtol=0, atol=0)
    assert torch.equal(unused.weight.main_grad, torch.zeros_like(unused.weight.main_grad))


def test_without_a_buffer_the_fused_layer_is_a_plain_linear():
    model = _mlp(torch.float32)
    apply_gradient_accumulation_fusion(model)
    reference = _mlp(torch.float32)
    x = torch.randn(3, 24)
    model(x).sum().backward()
    reference(x).sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


def test_swap_covers_plain_and_tensor_parallel_linears_of_the_blocks():
    cfg = build_config(None, ["--preset", "tiny-llama", "--vocab-size", "64", "--device", "cpu"])
    model = build_model(cfg.model, 64, 32)
    apply_gradient_accumulation_fusion(model.layers)
    linears = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FusedWgradLinear for m in linears)
    parallel = nn.ModuleList([ColumnParallelLinear(8, 8, False, None), RowParallelLinear(8, 8, False, None)])
    apply_gradient_accumulation_fusion(parallel)
    assert all(m.grad_accum_fusion for m in parallel)


def test_flag_is_on_by_default_and_combines_with_compile():
    """On by default, as Megatron's; --compile is accepted with it (the setup then leaves the blocks unfused)."""
    assert build_config(None, []).train.gradient_accumulation_fusion
    assert not build_config(None, ["--no-gradient-accumulation-fusion"]).train.gradient_accumulation_fusion
    validate(build_config(None, ["--gradient-accumulation-fusion", "--compile"]))


def _output_layer_grads(dtype: torch.dtype, kernels: str, fuse: bool, stale: float | None = None) -> torch.Tensor:
    """An untied output layer's ``main_grad`` after ``MICRO_BATCHES`` masked-sum losses, each
    backward scaled (as the trainer divides by the micro batches); ``stale`` fills the buffer first."""
    torch.manual_seed(0)
    layer = OutputLayer(16, 50, tied=False, fused_kernels=kernels).to(dtype)
    nn.init.normal_(layer.weight, std=0.2)
    buffer = GradBuffer([("weight", layer.weight)])
    if stale is not None:
        buffer.data.fill_(stale)
    if fuse:
        apply_gradient_accumulation_fusion(nn.Module(), [layer])
    for i in range(MICRO_BATCHES):
        gen = torch.Generator().manual_seed(i)
        hidden = torch.randn(2, 7, 16, generator=gen).to(dtype)
        labels = torch.randint(0, 50, (2, 7), generator=gen)
        labels[0, 0] = -100
        weights = (torch.rand(2, 7, generator=gen) > 0.3).float()
        (layer(hidden, labels, loss_weights=weights) * 0.37).backward()
    buffer.finish_grad_sync()
    assert layer.weight.grad is (layer.weight.main_grad if dtype == torch.float32 else None)
    return layer.weight.main_grad.clone()


@pytest.mark.parametrize("kernels", ["auto", "on"], ids=["reference", "triton"])
def test_output_layer_weight_gradient_goes_scaled_into_main_grad(kernels, monkeypatch):
    """The masked-sum loss's weight gradient (taken in the forward, scaled in backward) lands in
    ``main_grad`` in one pass: fp32 equal to the hook's path; bf16 written first over stale NaN
    (no rounding to bf16 before the scale, so equal to the hook's path at bf16's precision)."""
    if kernels == "on" and not triton_available():
        pytest.skip("needs Triton (its interpreter on the CPU)")
    calls = []
    scaled = cross_entropy_sum.accumulate_scaled_of
    monkeypatch.setattr(cross_entropy_sum, "accumulate_scaled_of", lambda *a: calls.append(a[3]) or scaled(*a))
    hook = _output_layer_grads(torch.float32, kernels, fuse=False)
    assert not calls
    torch.testing.assert_close(_output_layer_grads(torch.float32, kernels, fuse=True), hook, rtol=1e-6, atol=1e-7)
    fused_bf16 = _output_layer_grads(torch.bfloat16, kernels, fuse=True, stale=float("nan"))
    assert torch.isfinite(fused_bf16).all() and _rel(fused_bf16, hook) < 2e-2
    assert _rel(fused_bf16, hook) <= _rel(_output_layer_grads(torch.bfloat16, kernels, fuse=False), hook) * 1.01
    assert calls == [kernels == "on"] * (2 * MICRO_BATCHES)  # the fused path ran, with the kernel where asked


def test_a_tied_output_layer_keeps_the_autograd_path():
    layer = OutputLayer(16, 50, tied=True)
    apply_gradient_accumulation_fusion(nn.Module(), [layer])
    weight = nn.Parameter(torch.randn(50, 16))
    GradBuffer([("weight", weight)])
    hidden, labels = torch.randn(1, 4, 16), torch.randint(0, 50, (1, 4))
    layer(hidden, labels, tied_weight=weight, loss_weights=torch.ones(1, 4)).backward()
    assert layer.grad_accum_fusion and weight.grad is weight.main_grad and weight.main_grad.abs().sum() > 0

