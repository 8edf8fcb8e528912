"""The blockwise FP8 recipe (``kernels/fp8_blockwise.py``) on the CPU, against float64: each
block's quantize -> dequantize error within FP8's rounding, its power-of-two scale the largest that
fits; the GEMMs (reference, and the Triton kernels under TRITON_INTERPRET) against float64 GEMMs of
the dequantized operands; the linear's output and both gradients against float64 GEMMs of the
operands quantized as the recipe prescribes per GEMM; the flags, the fallback, recompute, and a
tiny model trained a few steps."""

import contextlib
import dataclasses

import pytest
import torch

from meshtron.config import ConfigError, build_config
from meshtron.kernels import fp8, triton_available
from meshtron.kernels.fp8_blockwise import BLOCK, block_cast, block_mm, dequantize, gemm_backend
from meshtron.kernels.fp8_recompute import recompute_contexts
from meshtron.kernels.fp8_scaling import FP8_FAMILIES, Fp8Recipe, Fp8Scaling
from meshtron.models import build_model
from meshtron.validation import validate

KERNELS = ["off"] + (["on"] if triton_available() and not torch.cuda.is_available() else [])  # reference; Triton's interpreter


def _tensor(n, k, seed, dtype=torch.float32):
    """Blocks of very different sizes (a zero block, a tiny row, a huge column), as real activations have."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(n, k, generator=gen) * torch.logspace(-3, 3, k // BLOCK).repeat_interleave(BLOCK)
    t[:BLOCK, BLOCK : 2 * BLOCK] = 0.0
    t[5] *= 1e-5
    t[:, 7] *= 300.0
    return t.to(dtype)


def _blocks(t: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """``t`` [n, k] -> [n / rows_per_block, k / 128, rows_per_block * 128]: one row per block."""
    n, k = t.shape
    return t.reshape(n // rows_per_block, rows_per_block, k // BLOCK, BLOCK).transpose(1, 2).reshape(n // rows_per_block, k // BLOCK, -1)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("family", FP8_FAMILIES)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_quantize_dequantize_within_fp8_rounding_per_block(source, family, kernels):
    """Each copy (1 x 128: rows and transposed; 128 x 128: rows and the same bytes transposed):
    every block's inverse scale a power of two with ``amax / inv`` in (fmax / 2, fmax], and every
    element within half an FP8 step of its float64 value (relative 2**-4 for normal e4m3, half the
    smallest subnormal times the block's inverse scale below)."""
    e4m3 = FP8_FAMILIES[family][0]
    fi = torch.finfo(e4m3)
    t = _tensor(256, 512, seed=1, dtype=source)
    exact = t.double()
    for tile, rows_per_block in ((False, 1), (True, BLOCK)):
        q = block_cast(t, e4m3, tile, rows=True, transposed=True, fused_kernels=kernels)
        for copy, inv, original in ((q.rows, q.rows_inv, exact), (q.transposed, q.transposed_inv, exact.t())):
            assert copy.dtype == e4m3 and inv.dtype == torch.float32
            assert inv.shape == (original.shape[0] // rows_per_block, original.shape[1] // BLOCK)
            mantissa, _ = torch.frexp(inv.double())
            assert (mantissa == 0.5).all()  # powers of two
            amax = _blocks(original, rows_per_block).abs().amax(-1)
            used = amax / inv.double()
            nonzero = amax > 0
            assert (used[nonzero] <= fi.max).all() and (used[nonzero] > fi.max / 2).all()
            error = (dequantize(copy, inv).double() - original).abs()
            step = torch.maximum(original.abs() * 2.0**-4, inv.double().repeat_interleave(rows_per_block, 0).repeat_interleave(BLOCK, 1) * fi.smallest_normal * 2.0**-4)  # fmt: skip
            assert (error <= step).all(), (tile, (error - step).max())
        if tile:
            assert torch.equal(q.transposed.view(torch.uint8), q.rows.t().view(torch.uint8))
            assert torch.equal(q.transposed_inv, q.rows_inv.t())
    # 1 x 128: the scales _scaled_mm wants outer-dim-major, the transposed copy's blocks run down the columns
    q = block_cast(t, e4m3, False, rows=True, transposed=True, fused_kernels=kernels)
    assert q.rows_inv.stride() == (1, 256) and q.transposed_inv.stride() == (1, 512)


@pytest.mark.skipif(len(KERNELS) < 2, reason="needs Triton's interpreter (no GPU)")
@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_cast_kernel_bit_equal_to_reference(family):
    """The Triton cast writes the reference's FP8 bytes and scales, in the same layouts."""
    e4m3 = FP8_FAMILIES[family][0]
    t = _tensor(256, 384, seed=2, dtype=torch.bfloat16)
    for tile in (False, True):
        for rows, transposed in ((True, True), (True, False), (False, True)):
            ref, fast = (block_cast(t, e4m3, tile, rows, transposed, mode) for mode in ("off", "on"))
            for a, b in zip(ref, fast, strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.shape == b.shape and a.stride() == b.stride()
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == e4m3 else torch.equal(a, b)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("weight_tiles", [True, False])  # forward / input gradient, weight gradient
def test_block_gemm_matches_float64_of_dequantized_operands(weight_tiles, kernels):
    a = block_cast(_tensor(256, 384, seed=3), torch.float8_e4m3fn, False, fused_kernels=kernels)
    b = block_cast(_tensor(384, 384, seed=4), torch.float8_e4m3fn, weight_tiles, fused_kernels=kernels)
    assert gemm_backend(a.rows, torch.float32, kernels) == ("triton" if kernels == "on" else "reference")
    da, db = dequantize(a.rows, a.rows_inv).double(), dequantize(b.rows, b.rows_inv).double()
    want, bound = da @ db.t(), _FP32_SUMS * (da.abs() @ db.abs().t())
    got = block_mm(a.rows, a.rows_inv, b.rows, b.rows_inv, torch.float32, kernels)
    assert ((got.double() - want).abs() <= bound).all()
    low = block_mm(a.rows, a.rows_inv, b.rows, b.rows_inv, torch.bfloat16, kernels)
    # within one bf16 step (Triton's interpreter stores bf16 by truncation, GPUs round to nearest)
    assert low.dtype == torch.bfloat16 and ((low.double() - want).abs() <= want.abs() * 2.0**-7 + bound).all()


# fp32 sums of a few hundred products: each result within this fraction of the sum of its terms'
# magnitudes (the worst case is K * 2**-24, 2.3e-5 at K = 384; rounding errors mostly cancel).
_FP32_SUMS = 1e-5


def _quantized(t: torch.Tensor, tile: bool) -> torch.Tensor:
    """What a GEMM reads of ``t`` along its rows (the reduction dimension), in float64."""
    q = block_cast(t, torch.float8_e4m3fn, tile, fused_kernels="off")
    return dequantize(q.rows, q.rows_inv).double()


@pytest.mark.parametrize("kernels", KERNELS)
def test_linear_and_its_gradients_match_float64(kernels):
    """Forward x (1 x 128) by w (128 x 128); input gradient g (1 x 128) by w^T (the same tiles);
    weight gradient g^T by x^T (both 1 x 128 along the tokens): each against float64 GEMMs of
    those quantized operands, and all three within a few percent of the unquantized GEMMs."""
    x, w, g = _tensor(2 * 128, 256, seed=5).view(2, 128, 256), _tensor(384, 256, seed=6) * 0.01, _tensor(256, 384, seed=7)
    bias = torch.randn(384, dtype=torch.float32, requires_grad=True)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.linear(xr, wr, bias, Fp8Scaling(Fp8Recipe("e4m3", "blockwise", fused_kernels=kernels)))
    y.backward(g.view(2, 128, 384))
    x2 = x.reshape(256, 256)
    gemms = ((_quantized(x2, False), _quantized(w, True)),  # each GEMM's (a, b) of a @ b^T, in float64
             (_quantized(g, False), _quantized(w.t().contiguous(), True)),
             (_quantized(g.t().contiguous(), False), _quantized(x2.t().contiguous(), False)))  # fmt: skip
    for got, (a, b) in zip((y.detach().view(256, 384) - bias.detach(), xr.grad.view(256, 256), wr.grad), gemms):
        assert ((got.double() - a @ b.t()).abs() <= _FP32_SUMS * (a.abs() @ b.abs().t()) + 1e-6 * bias.abs().max().item()).all()
    assert torch.equal(bias.grad, g.sum(0))
    exact = (x2.double() @ w.double().t(), g.double() @ w.double(), g.double().t() @ x2.double())
    for got, want in zip((y.detach().view(256, 384) - bias.detach(), xr.grad.view(256, 256), wr.grad), exact):
        assert ((got.double() - want).norm() / want.norm()) < 0.07


def test_refusals_fallback_and_no_state():
    """Hybrid is refused with the flag to change; a layer or call off the 128 grid runs bf16; the
    recipe keeps no state (nothing for recompute or checkpoints to carry)."""
    with pytest.raises(ValueError, match="--fp8-format e4m3"):
        Fp8Scaling(Fp8Recipe("hybrid", "blockwise"))
    for flags, message in [(["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"], "use --fp8-format e4m3"),
                           (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], "MXFP8")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            validate(build_config(overrides=flags))
    m = build_config(overrides=["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]).model
    assert (m.fp8_format, m.fp8_recipe) == ("e4m3", "blockwise")
    scaling = Fp8Scaling(Fp8Recipe("e4m3", "blockwise"))
    x, w = torch.randn(64, 256), torch.randn(128, 256)  # 64 tokens: not a whole block
    assert torch.equal(fp8.linear(x, w, None, scaling), torch.nn.functional.linear(x, w))
    assert scaling.amax_history.numel() == 0 and not list(scaling.state_dict())
    assert all(isinstance(c, contextlib.nullcontext) for c in recompute_contexts([scaling]))
    layers = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 48))
    fp8.apply_fp8(layers, Fp8Recipe("e4m3", "blockwise"), "meshtron")
    assert type(layers[0]) is fp8.Fp8Linear and type(layers[1]) is torch.nn.Linear  # 48 features: stays bf16


def _tiny(**fields):
    base = build_config(overrides=["--model.preset", "tiny-llama", "--num-layers", "2"]).model
    return dataclasses.replace(base, hidden_size=128, ffn_hidden_size=256, **fields)


def _train(cfg, recipe: Fp8Recipe | None, steps: int, lr: float = 3e-3):
    torch.manual_seed(0)
    model = build_model(cfg, 256, 64)
    if recipe is not None:
        fp8.apply_fp8(model.layers, recipe, "meshtron")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens, losses = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1)), []
    for _ in range(steps):  # one batch of 128 tokens again and again: the loss must fall
        loss = model(tokens, labels=torch.roll(tokens, -1, 1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), model


def test_tiny_model_trains_with_blockwise():
    """A tiny Llama whose block linears all take the recipe: finite losses that fall and stay
    within 2 % of the same run in fp32."""
    plain, _ = _train(_tiny(), None, 8)
    low, model = _train(_tiny(), Fp8Recipe("e4m3", "blockwise"), 8)
    assert sum(type(m) is fp8.Fp8Linear for m in model.modules()) == 8  # qkv, proj, fc1, fc2 per block
    assert torch.isfinite(low).all() and low[-1] < 0.9 * low[0]
    assert ((low - plain).abs() / plain).max() < 0.02, (low, plain)


def test_blockwise_under_recompute_equals_the_run_that_keeps_activations():
    """No state to snapshot: the rerun casts the same blocks, so losses are bit-equal."""
    recipe = Fp8Recipe("e4m3", "blockwise")
    plain, _ = _train(_tiny(), recipe, 3)
    again, _ = _train(_tiny(recompute_granularity="full"), recipe, 3)
    assert torch.equal(plain, again)
