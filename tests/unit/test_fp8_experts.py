"""FP8 experts (``layers/moe/fp8_grouped_gemm.py``) on the CPU: the rowwise casts, the grouped FP8
GEMM paths against float64, the autograd function's gradients, a MoE layer against bf16, the
weight-cast kernels under Triton's interpreter, and the config checks.

Error bounds: e4m3 rounds a normal value to within 2^-4 of itself (3 mantissa bits, half an ulp)
and a subnormal to within 2^-10 of the unit (half of 2^-9); scaled by ``inv`` that is
``|t - dequant(t)| <= 2^-4 |t| + 2^-10 inv``, and a product of two such operands summed over k
errs by at most the sum of those terms, plus bf16's rounding of the output (2^-8 relative).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from meshtron.config import ModelConfig, build_config
from meshtron.errors import ConfigError
from meshtron.kernels import triton_available
from meshtron.layers.moe import MoELayer
from meshtron.layers.moe.experts import expert_ffn
from meshtron.layers.moe.fp8_grouped_gemm import (
    fp8_grouped_mm,
    quantize_rows,
    quantize_weights,
    resolve_fp8_backend,
    scaled_grouped_mm,
)
from meshtron.layers.moe.validation import moe_config_errors
from meshtron.validation import validate

E4M3 = torch.float8_e4m3fn
NORMAL, SUBNORMAL, BF16 = 2.0**-4, 2.0**-10, 2.0**-8
SIZES = torch.tensor([7, 0, 25, 1, 15])  # an empty expert, a one-row expert, odd sizes


def _is_power_of_two(t: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(t)
    return bool((mantissa == 0.5).all())


def _operands(seed: int = 0, rows: int = 48, k: int = 64, n: int = 32, experts: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    x[3] *= 1e3  # rows of very different sizes: each gets its own scale
    x[5] = 0  # an all-zero row
    w = (torch.randn(experts, n, k, generator=g) * 0.05).to(torch.bfloat16)
    w[2, 4] *= 50
    return x, w


def _dequant_error_bound(t: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return NORMAL * t.abs() + SUBNORMAL * inv


def test_rows_get_power_of_two_scales_and_stay_within_e4m3_rounding():
    x, _ = _operands()
    q, inv = quantize_rows(x, E4M3)
    assert q.dtype == E4M3 and inv.shape == (x.shape[0],) and inv.dtype == torch.float32
    assert _is_power_of_two(inv) and torch.isfinite(inv).all()
    amax = x.float().abs().amax(1)
    assert ((amax / inv <= 448) & ((amax / inv > 224) | (amax == 0))).all()  # the largest power of two that fits
    err = (q.double() * inv[:, None].double() - x.double()).abs()
    assert (err <= _dequant_error_bound(x.double(), inv[:, None].double())).all()
    assert (q[5].float() == 0).all()


def test_weights_are_scaled_per_output_row_and_transposed_per_input_column():
    _, w = _operands()
    quant = quantize_weights(w, E4M3, rows=True, transposed=True)
    assert quant.rows.shape == w.shape and quant.rows_inv.shape == w.shape[:2]
    assert quant.transposed.shape == (w.shape[0], w.shape[2], w.shape[1]) and quant.transposed_inv.shape == (w.shape[0], w.shape[2])
    assert quant.transposed.is_contiguous() and _is_power_of_two(quant.rows_inv) and _is_power_of_two(quant.transposed_inv)
    rows = quant.rows.double() * quant.rows_inv[:, :, None].double()
    assert ((rows - w.double()).abs() <= _dequant_error_bound(w.double(), quant.rows_inv[:, :, None].double())).all()
    cols = (quant.transposed.double() * quant.transposed_inv[:, :, None].double()).transpose(1, 2)
    assert ((cols - w.double()).abs() <= _dequant_error_bound(w.double(), quant.transposed_inv[:, None, :].double())).all()
    only_rows = quantize_weights(w, E4M3, rows=True, transposed=False)
    assert only_rows.transposed is None and torch.equal(only_rows.rows.view(torch.uint8), quant.rows.view(torch.uint8))


def _grouped_float64(a: torch.Tensor, b: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """a [M, K] grouped times b[g] [N, K] transposed, in float64, one matmul per group."""
    return torch.cat([rows @ b[g].double().t() for g, rows in enumerate(torch.split(a.double(), sizes.tolist()))])


@pytest.mark.parametrize("backend", ["reference", "loop"])
def test_grouped_fp8_gemm_matches_float64(backend):
    """Each path equals float64 math on the dequantized operands (to bf16's rounding of the output,
    plus fp32 accumulation), and the unquantized product within the FP8 bound."""
    x, w = _operands()
    xq, x_inv = quantize_rows(x, E4M3)
    wq = quantize_weights(w, E4M3, True, False)
    out = scaled_grouped_mm(xq, x_inv, wq.rows, wq.rows_inv, SIZES, backend, torch.bfloat16)
    assert out.shape == (x.shape[0], w.shape[1]) and out.dtype == torch.bfloat16
    dequant = _grouped_float64(xq.double() * x_inv[:, None].double(), wq.rows.double() * wq.rows_inv[:, :, None].double(), SIZES)
    magnitude = _grouped_float64(xq.double().abs() * x_inv[:, None].double(), wq.rows.double().abs() * wq.rows_inv[:, :, None].double(), SIZES)
    assert ((out.double() - dequant).abs() <= BF16 * dequant.abs() + 1e-6 * magnitude).all()
    exact = _grouped_float64(x, w, SIZES)
    x_err = _dequant_error_bound(x.double(), x_inv[:, None].double())
    w_err = _dequant_error_bound(w.double(), wq.rows_inv[:, :, None].double())
    bound = _grouped_float64(x_err, w.double().abs() + w_err, SIZES) + _grouped_float64(x.double().abs(), w_err, SIZES)
    assert ((out.double() - exact).abs() <= bound + BF16 * exact.abs() + 1e-6 * magnitude).all()
    assert (bound <= 0.15 * _grouped_float64(x.double().abs(), w.double().abs(), SIZES) + 1e-3).all()  # the bound is not vacuous


def test_grouped_fp8_gemm_with_no_rows():
    _, w = _operands()
    empty = torch.zeros(0, w.shape[2], dtype=E4M3)
    wq = quantize_weights(w, E4M3, True, False)
    out = scaled_grouped_mm(empty, torch.ones(0), wq.rows, wq.rows_inv, torch.zeros(5, dtype=torch.long), "reference", torch.bfloat16)
    assert out.shape == (0, w.shape[1])


@pytest.mark.parametrize("backend", ["reference", "loop"])
def test_fp8_grouped_mm_forward_and_gradients(backend):
    """Output and input gradient within the FP8 bound of float64 (normwise here, elementwise above);
    the weight gradient is bf16's (fp32 accumulation of the bf16 operands)."""
    x, w = _operands(1)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = fp8_grouped_mm(x, w, SIZES, backend)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out.backward(grad)
    exact = _grouped_float64(x.detach(), w.detach(), SIZES)
    assert (out.double() - exact).norm() <= 0.05 * exact.norm()
    dx = torch.cat([g @ w.detach()[e].double() for e, g in enumerate(torch.split(grad.double(), SIZES.tolist()))])
    assert (x.grad.double() - dx).norm() <= 0.05 * dx.norm()
    parts = zip(torch.split(grad.double(), SIZES.tolist()), torch.split(x.detach().double(), SIZES.tolist()))
    dw = torch.stack([g.t() @ rows for g, rows in parts])
    assert (w.grad.double() - dw).norm() <= 4e-3 * dw.norm() and (w.grad[1] == 0).all()


@pytest.mark.skipif(not triton_available() or torch.cuda.is_available(), reason="needs Triton and no GPU (the interpreter)")
def test_weight_gradient_fused_into_main_grad(monkeypatch):
    """With gradient-accumulation fusion the weight gradient goes into ``main_grad`` by the Triton
    kernel (two micro batches summed there), as the unfused path computes it. fp32 operands: the
    interpreter's bf16 dot products are not exact on the CPU (the GPU test covers bf16)."""
    from meshtron.kernels import triton_grouped_gemm
    from meshtron.optim.grad_buffer import GradBuffer

    fused_calls, kernel = [], triton_grouped_gemm.group_weight_grad
    monkeypatch.setattr(triton_grouped_gemm, "group_weight_grad", lambda *a, **k: fused_calls.append(k.get("out")) or kernel(*a, **k))

    x, w = _operands(4)
    x, w = x.float(), w.float()
    weight = torch.nn.Parameter(w.clone())
    buffer = GradBuffer([("experts.weight1", weight)])
    plain = w.clone().requires_grad_(True)
    for seed in (5, 6):
        grad = torch.randn(x.shape[0], w.shape[1], generator=torch.Generator().manual_seed(seed))
        fp8_grouped_mm(x, weight, SIZES, "reference", fuse_wgrad=True).backward(grad)
        fp8_grouped_mm(x, plain, SIZES, "reference").backward(grad)
    buffer.finish_grad_sync()
    assert len(fused_calls) == 2 and all(out is not None for out in fused_calls)  # both micro batches into main_grad
    torch.testing.assert_close(weight.main_grad, plain.grad, rtol=1e-5, atol=1e-4)


def test_moe_layer_with_fp8_experts_stays_close_to_bf16():
    """A MoE layer (bf16, 8 experts top-2, SwiGLU) with FP8 experts against the same layer in bf16:
    the output, the input's and the experts' gradients within 12 % normwise, the router's within
    20 % (its gradient differences expert outputs). e4m3 keeps 3 mantissa bits: one FP8 GEMM of
    random operands errs ~4 % normwise, fc1 -> SwiGLU -> fc2 ~7 % (measured 6.9 %; gradients 7.7 to
    8.6 %, the router's 12 %)."""
    fields = dict(num_layers=2, hidden_size=64, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48, add_bias_linear=False,
                  activation="swiglu")  # fmt: skip
    layers = {}
    for fp8 in ("", "e4m3"):
        torch.manual_seed(0)
        layers[fp8] = MoELayer(ModelConfig(**fields, fp8_format=fp8, moe_fp8="rowwise")).to(torch.bfloat16)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    outs, grads = {}, {}
    for fp8, layer in layers.items():
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.float().square().sum().backward()
        outs[fp8] = out.double()
        grads[fp8] = {"x": xi.grad.double(), **{n: p.grad.double() for n, p in layer.named_parameters()}}
    assert 0 < (outs["e4m3"] - outs[""]).norm() <= 0.12 * outs[""].norm()  # FP8 ran, and stayed close
    for name, ref in grads[""].items():
        assert (grads["e4m3"][name] - ref).norm() <= (0.2 if name == "router.weight" else 0.12) * ref.norm(), name


def test_no_rows_run_the_bf16_path():
    """A rank whose experts receive no rows (expert parallelism) has nothing to scale: the bf16 GEMM's empty result."""
    _, w = _operands()  # [5, 32, 64]: fc1 64 -> 32, and its transpose as fc2 32 -> 64
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_experts=5, moe_ffn_hidden_size=32, add_bias_linear=False, fp8_format="e4m3", moe_fp8="rowwise")
    x = torch.zeros(0, 64, dtype=torch.bfloat16, requires_grad=True)
    w1 = w.clone().requires_grad_(True)
    out = expert_ffn(x, w1, w.transpose(1, 2).contiguous(), torch.zeros(5, dtype=torch.long), cfg)
    out.backward(torch.ones_like(out))
    assert out.shape == (0, 64) and (w1.grad == 0).all()


def test_widths_not_multiples_of_16_run_bf16():
    fields = dict(num_layers=2, hidden_size=24, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, add_bias_linear=False)
    outs = []
    for fp8 in ("", "e4m3"):
        torch.manual_seed(0)
        layer = MoELayer(ModelConfig(**fields, fp8_format=fp8, moe_fp8="rowwise")).to(torch.bfloat16)
        outs.append(layer(torch.ones(1, 4, 24, dtype=torch.bfloat16)))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not triton_available() or torch.cuda.is_available(), reason="needs Triton and no GPU (the interpreter)")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_weight_cast_kernels_are_bit_equal_to_the_reference(dtype):
    """The weights' kernels (both amaxes in one pass, both copies in another) and the rows' one
    (Triton's interpreter) make what the torch ops make, bit for bit."""
    _, w = _operands(2, k=80, n=48)  # tiles cut at the edges
    w[1, :, 7] = 0  # an all-zero column and row
    w[3, 2] = 0
    kernel = quantize_weights(w, dtype, True, True, fused_kernels="on")
    reference = quantize_weights(w, dtype, True, True, fused_kernels="off")
    x, _ = _operands(3, rows=50, k=80)
    x[7] = 2.0**-130  # subnormal bf16: the scale's division at the edge of fp32
    x[9] = 448 / 1024  # amax * scale exactly fmax
    kernel += quantize_rows(x, dtype, "on")
    reference += quantize_rows(x, dtype, "off")
    for got, want in zip(kernel, reference):
        assert torch.equal(got.view(torch.uint8) if got.dtype == dtype else got, want.view(torch.uint8) if want.dtype == dtype else want)


def test_backend_choice_and_refusals():
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert resolve_fp8_backend(x, "auto") == "reference"  # the CPU: dequantized math
    assert resolve_fp8_backend(x, "loop") == "loop"
    with pytest.raises(RuntimeError, match="_scaled_grouped_mm does not run"):
        resolve_fp8_backend(x, "torch")
    with pytest.raises(ValueError, match="no Triton FP8 grouped GEMM"):
        resolve_fp8_backend(x, "triton")


def test_config_checks():
    moe = dict(num_layers=2, hidden_size=64, num_experts=4, moe_router_topk=2, add_bias_linear=False)
    assert any("no Triton FP8 grouped GEMM" in e for e in moe_config_errors(ModelConfig(**moe, fp8_format="e4m3", moe_grouped_gemm="triton", moe_fp8="rowwise")))
    assert not moe_config_errors(ModelConfig(**moe, fp8_format="e4m3", moe_grouped_gemm="triton", moe_fp8="off"))
    assert not moe_config_errors(ModelConfig(**moe, moe_grouped_gemm="triton"))  # bf16: any backend
    assert any("model.moe_fp8 must be" in e for e in moe_config_errors(ModelConfig(**moe, moe_fp8="tensorwise")))


@pytest.mark.parametrize("flags,message", [
    (["--fp8-format", "e4m3", "--model.moe_fp8", "rowwise", "--model.moe_grouped_gemm", "triton"], "no Triton FP8 grouped GEMM; change triton or set model.moe_fp8 off"),
    (["--fp8-format", "hybrid", "--model.moe_fp8", "rowwise", "--fp32"], "FP8 experts .* train in bf16 \\(not fp32\\)"),
    (["--fp8-format", "hybrid", "--model.moe_fp8", "blockwise"], "model.moe_fp8 must be one of rowwise, off"),
])  # fmt: skip
def test_bad_combinations_fail_before_anything_is_built(flags, message):
    moe = ["--preset", "tiny-deepseek", "--mock-data", "--device", "cuda"]
    with pytest.raises(ConfigError, match=message):
        validate(build_config(None, moe + flags))
    validate(build_config(None, moe + ["--fp8-format", "hybrid", "--model.moe_fp8", "rowwise", "--bf16"]))  # the good combination passes


def test_step_cache_keeps_a_parameters_values_inside_its_scope_only():
    from meshtron.kernels import step_cache

    param, made = torch.nn.Parameter(torch.ones(4)), []

    def make():
        made.append(1)
        return len(made)

    assert step_cache.derived(param, "v", make) == 1 and step_cache.derived(param, "v", make) == 2  # no scope: made each call
    with step_cache.scope():
        assert step_cache.derived(param, "v", make) == 3 and step_cache.derived(param, "v", make) == 3
        with step_cache.scope():  # an inner scope shares the outer one's values
            assert step_cache.derived(param, "v", make) == 3
        assert step_cache.derived(param[:2], "v", make) == 4 and step_cache.derived(param[:2], "v", make) == 5  # views: never kept
        assert step_cache.derived(param, "w", make) == 6  # another value of the same parameter
    assert step_cache.derived(param, "v", make) == 7  # the scope's values are gone


def test_a_step_of_several_micro_batches_casts_each_expert_weight_once(monkeypatch):
    """Two micro batches through the runner: each expert weight is cast once for both (and the
    results are bit for bit those of casting it for each micro batch)."""
    from meshtron.config import ParallelConfig, TrainConfig
    from meshtron.kernels import step_cache
    from meshtron.layers.moe import fp8_grouped_gemm
    from meshtron.models import build_model
    from meshtron.parallel.mesh import Mesh
    from meshtron.parallel.setup import runner_for

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                      activation="swiglu", add_bias_linear=False, fp8_format="e4m3", moe_fp8="rowwise", moe_layer_freq="([0]+[1])")  # fmt: skip
    g = torch.Generator().manual_seed(7)
    batches = [{"tokens": torch.randint(0, 100, (2, 16), generator=g), "labels": torch.randint(0, 100, (2, 16), generator=g),
                "loss_mask": torch.ones(2, 16)} for _ in range(2)]  # fmt: skip
    casts, quantize = [], fp8_grouped_gemm.quantize_weights
    monkeypatch.setattr(fp8_grouped_gemm, "quantize_weights", lambda *a, **k: casts.append(1) or quantize(*a, **k))

    def step() -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        runner = runner_for(build_model(cfg, 100, 16), Mesh(rank=0), ParallelConfig(), TrainConfig(), torch.bfloat16)
        runner.optimizer.zero_grad()
        runner.forward_backward(batches)
        runner.finalize_grads()
        return {n: p.main_grad.clone() for n, p in runner.model.named_parameters()}

    kept = step()
    assert len(casts) == 2  # one MoE layer: weight1 and weight2, once each for both micro batches
    monkeypatch.setattr(step_cache, "scope", contextlib.nullcontext)
    casts.clear()
    each = step()
    assert len(casts) == 4
    for name, grad in kept.items():
        assert torch.equal(grad, each[name]), name
