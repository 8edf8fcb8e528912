"""FP8 linear layers on the CPU: the quantize/dequantize math, the three GEMMs against an fp32
simulation (FP8 round trips, then fp32 matmuls), the layer swap, and the early CPU refusal."""

import dataclasses

import pytest
import torch
from torch import nn

from meshtron.config import ConfigError, build_config
from meshtron.validation import validate
from meshtron.kernels import fp8
from meshtron.layers.output import OutputLayer
from meshtron.models import build_model
from meshtron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _dequantize(q: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of ``fp8.quantize``: what the quantized tensor stands for."""
    return (q.float() * inv_scale).to(dtype)


def _simulated(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the GEMM sees of ``t``: its FP8 round trip, in fp32."""
    return _dequantize(*fp8.quantize(t, dtype))


def _scaled_mm_runs_on_cpu() -> bool:
    a = torch.ones(16, 16).to(fp8.E5M2)
    b = torch.ones(16, 16).to(fp8.E4M3)
    try:
        torch._scaled_mm(a, b.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("dtype,rel", [(fp8.E4M3, 2**-4), (fp8.E5M2, 2**-3)])
def test_quantize_round_trip(dtype, rel):
    t = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 3.0
    q, inv = fp8.quantize(t, dtype)
    assert q.dtype == dtype and inv.dtype == torch.float32 and inv.ndim == 0
    assert q.float().abs().max() == torch.finfo(dtype).max  # amax lands on the format's largest value
    back = _dequantize(q, inv)
    normal = t.abs() > t.abs().max() * 2**-6  # away from the subnormal range, half an ulp at most
    assert ((back - t).abs() <= t.abs() * rel)[normal].all()
    assert (back - t).abs().max() <= t.abs().max() * rel


def test_quantize_zero_and_bf16():
    q, inv = fp8.quantize(torch.zeros(16, 16), fp8.E4M3)
    assert torch.isfinite(inv) and q.float().abs().sum() == 0
    t = torch.randn(32, 32)
    back_bf16 = _dequantize(*fp8.quantize(t.bfloat16(), fp8.E4M3))
    assert (back_bf16 - t).abs().max() <= t.abs().max() * 2**-3


@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
def test_simulated_fp8_linear_close_to_fp32(fmt):
    """The error budget the training loss sees: each GEMM of FP8 operands within a few percent."""
    gen = torch.Generator().manual_seed(1)
    x, w, g = torch.randn(64, 32, generator=gen), torch.randn(48, 32, generator=gen) * 0.1, torch.randn(64, 48, generator=gen)
    gd = fp8.grad_dtype(fmt)
    pairs = [
        (_simulated(x, fp8.E4M3) @ _simulated(w, fp8.E4M3).T, x @ w.T),
        (_simulated(g, gd) @ _simulated(w, fp8.E4M3), g @ w),
        (_simulated(g, gd).T @ _simulated(x, fp8.E4M3), g.T @ x),
    ]
    for approx, exact in pairs:
        assert (approx - exact).norm() / exact.norm() < 0.06


@pytest.mark.skipif(not _scaled_mm_runs_on_cpu(), reason="this torch has no CPU _scaled_mm for mixed FP8 types")
@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
def test_fp8_linear_matches_simulation(fmt):
    """The autograd function's three ``_scaled_mm`` GEMMs equal the fp32 simulation of the same
    quantized operands (only the summation order differs)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 16, 32, generator=gen, requires_grad=True)
    w = (torch.randn(48, 32, generator=gen) * 0.1).requires_grad_()
    b = torch.randn(48, generator=gen, requires_grad=True)
    g = torch.randn(2, 16, 48, generator=gen)
    y = fp8.linear(x, w, b, fmt)
    y.backward(g)
    x2, g2, gd = x.detach().reshape(-1, 32), g.reshape(-1, 48), fp8.grad_dtype(fmt)
    torch.testing.assert_close(y.detach(), (_simulated(x2, fp8.E4M3) @ _simulated(w.detach(), fp8.E4M3).T + b.detach()).view(2, 16, 48))
    torch.testing.assert_close(x.grad, (_simulated(g2, gd) @ _simulated(w.detach(), fp8.E4M3)).view(2, 16, 32))
    torch.testing.assert_close(w.grad, _simulated(g2, gd).T @ _simulated(x2, fp8.E4M3))
    torch.testing.assert_close(b.grad, g.sum((0, 1)))


def test_linear_falls_back_where_shapes_do_not_fit():
    x, w = torch.randn(3, 5, 24), torch.randn(40, 24)  # 15 tokens, 40 features: not multiples of 16
    assert torch.equal(fp8.linear(x, w, None, "hybrid"), torch.nn.functional.linear(x, w))
    assert torch.equal(fp8.linear(x, w, None, ""), torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="fp8 format"):
        fp8.grad_dtype("e5m2")


def test_apply_fp8_swaps_block_linears_only():
    cfg = build_config(overrides=["--model.preset", "tiny-llama"]).model
    model = build_model(dataclasses.replace(cfg, tie_embeddings=False), 128, 16)
    keys = list(model.state_dict())
    assert fp8.apply_fp8(model.layers, "e4m3", "meshtron") == "meshtron"
    swapped = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    assert swapped and all(type(m) is fp8.Fp8Linear and m.fp8_format == "e4m3" for m in swapped)
    assert type(model.output) is OutputLayer  # the output layer stays bf16
    assert list(model.state_dict()) == keys


def test_parallel_linears_run_the_same_function():
    """One-rank parallel linears given ``fp8_format`` compute what ``Fp8Linear`` computes."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 32, generator=gen), torch.randn(48, 32, generator=gen)
    column, row = ColumnParallelLinear(32, 48, False, None), RowParallelLinear(32, 48, False, None)
    block = nn.Sequential(column, row)
    fp8.apply_fp8(block, "hybrid", "meshtron")
    assert column.fp8_format == row.fp8_format == "hybrid"
    for layer in (column, row):
        layer.weight.data.copy_(w)
        if _scaled_mm_runs_on_cpu():
            torch.testing.assert_close(layer(x), fp8.linear(x, w, None, "hybrid"))


def test_fp8_fails_early_on_the_cpu():
    with pytest.raises(ValueError, match="needs a GPU with FP8"):
        fp8.check_fp8_device(torch.device("cpu"))
    with pytest.raises(ConfigError, match="need a GPU"):
        validate(build_config(overrides=["--fp8-format", "hybrid", "--device", "cpu"]))
    with pytest.raises(ConfigError, match="--fp8-format must be"):
        validate(build_config(overrides=["--fp8-format", "e5m2"]))
    cfg = build_config(overrides=["--fp8-format", "hybrid", "--compile", "--gemm-tuning"])
    assert (cfg.model.fp8_format, cfg.train.compile, cfg.train.gemm_tuning) == ("hybrid", True, True)
