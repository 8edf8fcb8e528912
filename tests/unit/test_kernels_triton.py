"""The Triton kernels against their references on the CPU, through Triton's interpreter (fp32).

Skipped where Triton is not installed (CI) and where a GPU is present (tests/gpu runs them
compiled, in bf16): the interpreter is switched on for the whole process by an environment
variable read when the kernels are first defined, which must not happen on a GPU machine.
"""

import os

import pytest
import torch

from meshtron.kernels import triton_available

pytestmark = pytest.mark.skipif(
    not triton_available() or torch.cuda.is_available(), reason="needs Triton, and no GPU (then tests/gpu covers it)"
)
if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from meshtron.kernels.checks import run_checks  # noqa: E402


# Seed 1 draws other inputs for the same kernels at the same shapes as seed 0 (12 s of interpreter): slow only.
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_kernels_match_references_fp32(seed):
    results = run_checks("cpu", torch.float32, seed=seed)
    assert {r.name for r in results} >= {"rmsnorm", "layernorm", "swiglu", "bias+gelu", "bias+gelu tanh", "rope", "linear+cross-entropy", "linear+bias+cross-entropy sum"}
    for r in results:
        assert r.forward < 1e-5 and r.backward < 1e-5, r


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz])
def test_fp8_cast_kernel_bit_equal_to_reference(dtype):
    """The one-pass cast(+transpose) kernel: same FP8 bytes and amax as the reference for a
    per-tensor scale (one that saturates too), per-row and per-column scales, ragged tiles, zeros
    (negative ones too: the fnuz formats have only +0) and values down in FP8's subnormals, for
    the OCP formats and AMD gfx942's fnuz ones."""
    from meshtron.kernels.fp8_cast import fp8_cast

    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(70, 100, generator=gen) * 3).bfloat16()
    t[3, 5], t[3, 6], t[4] = 0.0, -0.0, t[4] * 1e-6
    fmax = torch.finfo(dtype).max
    amax = t.float().abs()
    for scale in (fmax / amax.max(), 4 * fmax / amax.max(), fmax / amax.amax(1, keepdim=True), fmax / amax.amax(0, keepdim=True)):
        fast, ref = (fp8_cast(t, scale, dtype, True, True, True, mode) for mode in ("on", "off"))
        assert torch.equal(fast.rows.view(torch.uint8), ref.rows.view(torch.uint8))
        assert torch.equal(fast.transposed.view(torch.uint8), ref.transposed.view(torch.uint8))
        assert fast.amax.item() == ref.amax.item() == amax.max().item()
    only_amax = fp8_cast(t, None, dtype, False, False, True, "on")
    assert only_amax.rows is None and only_amax.transposed is None and only_amax.amax.item() == amax.max().item()


@pytest.mark.parametrize("tile", [(32, 64, 4), (64, 32, 8)])
def test_fp8_cast_kernel_tiles_agree(tile):
    """A rectangular tile of the cast kernel (the sizes ``benchmarks/fp8_cast_sweep.py`` times) writes
    the same bytes, transposed copy and amax as the default tile, on ragged edges."""
    from meshtron.kernels.triton_fp8_cast import TILE, cast

    t = (torch.randn(70, 100, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    scale = torch.tensor(100.0)
    want, got = (cast(t, scale, torch.float8_e4m3fn, True, True, True, shape) for shape in (TILE, tile))
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert got[2].item() == want[2].item() == t.float().abs().max().item()


def test_fp8_cast_kernel_makes_the_cross_entropy_gradient_on_the_way():
    """The cast kernel given a chunk of bf16 logits and ``ce_gradient`` casts their gradient
    ``(softmax - onehot) * grad`` (the FP8 output layer's one pass) to the bytes the reference makes
    from ``chunk_backward_reference``'s bf16 gradient, both layouts, ragged tiles; labels outside
    the chunk and ignored rows (grad 0) included."""
    from meshtron.kernels.cross_entropy import chunk_backward_reference
    from meshtron.kernels.fp8_cast import cast_reference
    from meshtron.kernels.triton_fp8_cast import cast

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(70, 100, generator=gen) * 4).bfloat16()
    start, labels = 200, torch.randint(150, 350, (70,), generator=gen)  # about half inside columns 200..299
    lse = torch.logsumexp(logits.float(), 1) + 0.5  # other chunks' share of the sum
    grad = torch.rand(70, generator=gen) / 70
    grad[::7] = 0.0
    dtype = torch.float8_e5m2
    scale = torch.finfo(dtype).max / grad.max()
    want = cast_reference(chunk_backward_reference(logits.clone(), labels, start, lse, grad), scale, dtype, True, True, False)
    got = cast(logits, scale, dtype, True, True, False, ce_gradient=(labels, lse, grad, start))
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("family", ["ocp", "fnuz"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "rowwise"])
def test_fp8_linear_with_kernels_equals_reference(recipe, family):
    """The FP8 linear over three calls (delayed: from its history after the first) gives the same
    outputs, gradients and amax histories with the cast kernels as with the reference casts, in
    either FP8 family."""
    from meshtron.kernels import fp8
    from meshtron.kernels.fp8_scaling import Fp8Recipe, Fp8Scaling

    runs = []
    for mode in ("on", "off"):
        scaling = Fp8Scaling(Fp8Recipe("hybrid", recipe, amax_history_len=2, amax_compute_algo="max", fused_kernels=mode),
                             family=family)  # fmt: skip
        gen, outs = torch.Generator().manual_seed(1), []
        for _ in range(3):
            x = torch.randn(48, 32, generator=gen).bfloat16().requires_grad_()
            w = (torch.randn(16, 32, generator=gen) * 0.1).bfloat16().requires_grad_()
            y = fp8.linear(x, w, None, scaling)
            y.backward(torch.randn(48, 16, generator=gen).bfloat16())
            outs += [y.detach(), x.grad, w.grad]
        runs.append((outs, scaling.amax_history.clone()))
    (fast, fast_history), (ref, ref_history) = runs
    for a, b in zip(fast, ref):
        assert torch.equal(a, b)
    assert torch.equal(fast_history, ref_history)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_cast_ops_trace_under_compile(recipe):
    """``torch.compile`` keeps the casts as the opaque ops ``meshtron::fp8_cast`` and (delayed,
    mutating the amax history) ``meshtron::fp8_delayed_cast``, with no graph break: over three
    calls the compiled FP8 linear equals the eager one, histories included."""
    from meshtron.kernels import fp8
    from meshtron.kernels.fp8_scaling import Fp8Recipe

    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        layer = torch.nn.Linear(32, 16, bias=False).bfloat16()
        recipe_ = Fp8Recipe("hybrid", recipe, amax_history_len=2, amax_compute_algo="max", fused_kernels="on")
        holder = torch.nn.Sequential(layer)
        fp8.apply_fp8(holder, recipe_, "meshtron")
        layer = holder[0]  # the FP8 linear that took its place (same parameters)
        run = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
        gen, outs = torch.Generator().manual_seed(1), []
        for step in range(3):
            x = (torch.randn(48, 32, generator=gen) * (step + 1)).bfloat16().requires_grad_()
            y = run(x)
            y.backward(torch.randn(48, 16, generator=gen).bfloat16())
            outs += [y.detach(), x.grad, layer.weight.grad.clone(), layer.fp8.amax_history.clone()]
            layer.weight.grad = None
        runs.append(outs)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunk", [0, 100])
def test_cross_entropy_kernels_stop_at_the_real_rows(chunk):
    """A padded vocabulary through the Triton pointwise kernels: the per-token loss and the masked
    sum (one token block and several) equal the unpadded reference, and the padded rows (whose
    logits would hold every bit of mass) get no gradient. Chunks of 100 end inside the real rows."""
    from meshtron.kernels.cross_entropy import linear_cross_entropy
    from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum

    gen = torch.Generator().manual_seed(0)
    tokens, hidden = 300, torch.randn(12, 16, generator=gen)
    weight = torch.cat([torch.randn(tokens, 16, generator=gen), torch.full((84, 16), 30.0)])
    labels, mask = torch.randint(0, tokens, (12,), generator=gen), torch.rand(12, generator=gen)
    labels[2] = -100
    ref_h, ref_w = hidden.clone().requires_grad_(True), weight[:tokens].clone().requires_grad_(True)
    want = linear_cross_entropy(ref_h, ref_w, labels, "off")
    (want * mask).sum().backward()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    torch.testing.assert_close(linear_cross_entropy(h, w, labels, "on", chunk_size=chunk, real_rows=tokens), want.detach())
    for budget in (2**30, 16 * tokens * 4):
        h.grad = w.grad = None
        total = linear_cross_entropy_sum(h, w, labels, mask, "on", chunk_size=chunk, budget_bytes=budget, real_rows=tokens)
        total.backward()
        torch.testing.assert_close(total, (want * mask).sum().detach())
        torch.testing.assert_close(h.grad, ref_h.grad)
        torch.testing.assert_close(w.grad[:tokens], ref_w.grad)
        assert w.grad[tokens:].abs().max() == 0


def test_fp8_output_layer_through_the_kernels():
    """``--fp8-output-layer`` with the Triton chunk and FP8 cast kernels (``fused_kernels`` on, in the
    loss and the recipe) against the same FP8 loss on the torch references: loss and gradients within
    fp32 rounding (1e-4 allows a few FP8 roundings decided otherwise), padded rows without gradient."""
    from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum
    from meshtron.kernels.fp8_scaling import Fp8Recipe, Fp8Scaling

    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(32, 16, generator=gen), torch.randn(320, 16, generator=gen) * 0.3
    labels, mask = torch.randint(0, 300, (32,), generator=gen), torch.rand(32, generator=gen)
    runs = []
    for kernels in ("on", "off"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        scaling = Fp8Scaling(Fp8Recipe("hybrid", "delayed", fused_kernels=kernels))
        total = linear_cross_entropy_sum(h, w, labels, mask, "on" if kernels == "on" else "auto", chunk_size=96,
                                         real_rows=300, fp8=scaling)  # fmt: skip
        total.backward()
        runs.append((total.detach(), h.grad, w.grad))
    for got, want in zip(*runs):
        assert ((got - want).norm() / want.norm()).item() < 1e-4
    assert runs[0][2][300:].abs().max() == 0


def test_dropout_add_kernel_keeps_one_mask_for_forward_and_backward():
    """``residual + dropout(x)`` in one pass (``checks.dropout_add_check``): forward and backward use
    one mask, each F.dropout's arithmetic rounded once; about 1 - p kept; the seed comes from
    torch's generator, so a reseed repeats the masks and the next call draws a new one. fp32 here
    (the interpreter rounds to bf16 its own way); tests/gpu runs it in bf16 too."""
    from meshtron.kernels.checks import dropout_add_check

    result = dropout_add_check("cpu", torch.float32, 64, 257, p=0.3)
    assert result.forward == 0 and result.backward == 0, result
    assert abs(result.kept - 0.7) < 0.02 and result.repeats and result.fresh, result


def test_dropout_add_recompute_draws_the_forward_mask():
    """Under activation recompute (the RNG state restored) the backward's mask is the first forward's."""
    from torch.utils.checkpoint import checkpoint

    from meshtron.kernels.dropout_add import dropout_add

    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(8, 300, generator=gen).requires_grad_() for _ in range(2))
    out = checkpoint(lambda a, r: dropout_add(a * 2, r, 0.5, True, "on"), x, residual, use_reentrant=False)
    kept = out.detach() != residual.detach()
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.where(kept, 4.0, 0.0), rtol=0, atol=0)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_kernel_sums_the_bias_gradient_over_row_blocks(approximate):
    """More rows than one program sums (600: two full blocks of 256 and a ragged one) and a ragged
    column block: output, input gradient and the bias gradient from the per-block partial sums
    against ``F.gelu(h + bias)`` (fp32, 1e-6 of the norm)."""
    from meshtron.kernels.bias_gelu import bias_gelu
    from meshtron.kernels.checks import relative_error

    gen = torch.Generator().manual_seed(2)
    h, bias, upstream = torch.randn(600, 200, generator=gen), torch.randn(200, generator=gen), torch.randn(600, 200, generator=gen)
    results = []
    for mode in ("on", "off"):
        leaves = (h.clone().requires_grad_(), bias.clone().requires_grad_())
        out = bias_gelu(*leaves, approximate, mode)
        out.backward(upstream)
        results.append((out.detach(), leaves[0].grad, leaves[1].grad))
    for fast, ref in zip(*results):
        assert relative_error(fast, ref) < 1e-6
