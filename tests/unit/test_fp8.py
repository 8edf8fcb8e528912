"""FP8 linear layers on the CPU: each recipe's three GEMMs against an fp32 simulation of the same
quantized operands (FP8 round trips, then fp32 matmuls), delayed scaling's amax histories over
several calls, a tiny model trained a few steps per recipe, the layer swap, and the config."""

import dataclasses

import pytest
import torch
from torch import nn

from meshtron.config import ConfigError, build_config
from meshtron.kernels import fp8
from meshtron.kernels.fp8_scaling import FP8_FAMILIES, FP8_FORMATS, FP8_RECIPES, Fp8Recipe, Fp8Scaling, grad_dtype

# The recipes whose scales are per tensor or per row; blockwise (128-multiples, e4m3) has its own tests:
# tests/unit/test_fp8_blockwise.py.
RECIPES = [r for r in FP8_RECIPES if r != "blockwise"]
from meshtron.layers.output import OutputLayer
from meshtron.models import build_model
from meshtron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from meshtron.validation import validate


def _simulated(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """What a GEMM sees of ``t``, in fp32: scaled (from its amax over ``dim``, all of it when None,
    or by ``scale``) in fp32, rounded to ``t``'s dtype, clamped, cast to FP8, and scaled back."""
    fmax = torch.finfo(dtype).max
    if scale is None:
        amax = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
        scale = fmax / amax.float().clamp(min=1e-12)
    q = (t.float() * scale).to(t.dtype).clamp(-fmax, fmax).to(dtype)
    return q.float() / scale


def _gemms(x, w, g, recipe: str, fmt: str, scales=(None, None, None), family: str = "ocp"):
    """The three GEMMs of a linear on simulated operands: x, w, g [M, K], [N, K], [M, N]; each
    operand quantized along the GEMM's reduction dimension for ``rowwise``."""
    E4M3 = FP8_FAMILIES[family][0]
    gd = E4M3 if recipe == "rowwise" else grad_dtype(fmt, family)
    row, col = (1, 0) if recipe == "rowwise" else (None, None)
    sx, sw, sg = scales
    y = _simulated(x, E4M3, row, sx) @ _simulated(w, E4M3, row, sw).T
    grad_x = _simulated(g, gd, row, sg) @ _simulated(w, E4M3, col, sw)
    grad_w = _simulated(g, gd, col, sg).T @ _simulated(x, E4M3, col, sx)
    return y, grad_x, grad_w


def _run(layer_fp8, x, w, g, bias=None):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.linear(x, w, bias, layer_fp8)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def _rand(*shape, gen, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("family", FP8_FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fp8_linear_matches_simulation(recipe, fmt, family):
    """Each recipe's three ``_scaled_mm`` GEMMs equal the fp32 simulation of the same quantized
    operands (only the summation order differs), in the OCP and the fnuz formats (AMD gfx942);
    bias and input shape handled around them."""
    gen = torch.Generator().manual_seed(2)
    x, w, g = _rand(2, 16, 32, gen=gen), _rand(48, 32, gen=gen, scale=0.1), _rand(2, 16, 48, gen=gen)
    b = torch.randn(48, generator=gen, requires_grad=True)
    y, grad_x, grad_w = _run(Fp8Scaling(Fp8Recipe(fmt, recipe), family=family), x, w, g, b)
    sim = _gemms(x.reshape(-1, 32), w, g.reshape(-1, 48), recipe, fmt, family=family)
    torch.testing.assert_close(y, (sim[0] + b.detach()).view(2, 16, 48))
    torch.testing.assert_close(grad_x, sim[1].view(2, 16, 32))
    torch.testing.assert_close(grad_w, sim[2])
    torch.testing.assert_close(b.grad, g.sum((0, 1)))
    exact = (x @ w.T, g @ w, g.reshape(-1, 48).T @ x.reshape(-1, 32))
    for got, want in zip((y - b.detach(), grad_x, grad_w), exact):  # the error budget the loss sees: a few percent
        assert (got - want).norm() / want.norm() < 0.07


def test_bf16_operands_match_simulation():
    """bf16 activations: the scaled product is rounded to bf16 before the cast, as simulated."""
    gen = torch.Generator().manual_seed(4)
    x, w, g = (_rand(32, 64, gen=gen, dtype=torch.bfloat16), _rand(16, 64, gen=gen, scale=0.05, dtype=torch.bfloat16),
               _rand(32, 16, gen=gen, dtype=torch.bfloat16))  # fmt: skip
    for recipe in RECIPES:
        got = _run(Fp8Scaling(Fp8Recipe("hybrid", recipe)), x, w, g)
        for a, b in zip(got, _gemms(x, w, g, recipe, "hybrid")):
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a.float(), b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("family, fmax", [("ocp", (448.0, 448.0, 57344.0)), ("fnuz", (240.0, 240.0, 57344.0))])
@pytest.mark.parametrize("algo", ["most_recent", "max"])
@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_scaling_uses_the_history_of_earlier_calls(algo, margin, family, fmax):
    """Call 1 scales from the current amaxes; each later call from the history before it (largest
    or most recent entry, over 2**margin) and the format's maximum; every call's amaxes enter the
    history afterwards, most recent first; a forward without grad reads the history and leaves it alone."""
    recipe = Fp8Recipe("hybrid", "delayed", amax_history_len=3, amax_compute_algo=algo, margin=margin)
    scaling = Fp8Scaling(recipe, family=family)
    gen = torch.Generator().manual_seed(5)
    amaxes = []  # per call: (input, weight, grad)
    for call, size in enumerate([1.0, 4.0, 0.5, 2.0]):  # a call 4x larger than the last: saturates
        x, w, g = _rand(32, 16, gen=gen, scale=size), _rand(48, 16, gen=gen, scale=0.1), _rand(32, 48, gen=gen, scale=size)
        if call == 0:
            scales = (None, None, None)
        else:
            history = torch.tensor(amaxes[-3:][::-1]).T  # rows input, weight, grad; most recent first
            picked = history.amax(1) if algo == "max" else history[:, 0]
            scales = tuple(torch.tensor(fmax) / picked / 2**margin)
        got = _run(scaling, x, w, g)
        for a, b in zip(got, _gemms(x, w, g, "delayed", "hybrid", scales, family)):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # another scale moves elements by FP8 steps (6 %)
        amaxes.append([x.abs().max().item(), w.abs().max().item(), g.abs().max().item()])
        recent = torch.tensor(amaxes[-3:][::-1]).T
        torch.testing.assert_close(scaling.amax_history[:, : recent.shape[1]], recent)
    before = scaling.amax_history.clone()
    with torch.no_grad():
        fp8.linear(_rand(32, 16, gen=gen, scale=9.0), _rand(48, 16, gen=gen), None, scaling)
    assert torch.equal(scaling.amax_history, before)


def test_scaling_state_stays_out_of_state_dicts_and_fp32():
    cfg = build_config(overrides=["--model.preset", "tiny-llama"]).model
    model = build_model(dataclasses.replace(cfg, tie_embeddings=False), 128, 16)
    keys = list(model.state_dict())
    assert fp8.apply_fp8(model.layers, Fp8Recipe("e4m3", "delayed", amax_history_len=4), "meshtron") == "meshtron"
    swapped = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    assert swapped and all(type(m) is fp8.Fp8Linear and m.fp8.recipe.format == "e4m3" for m in swapped)
    assert type(model.output) is OutputLayer  # the output layer stays bf16
    assert list(model.state_dict()) == keys  # checkpoints and exports unchanged
    model.to(torch.bfloat16)
    assert all(m.fp8.amax_history.dtype == torch.float32 and m.fp8.amax_history.shape == (3, 4) for m in swapped)


@pytest.mark.parametrize("recipe", RECIPES)
def test_tiny_model_trains_with_each_recipe(recipe):
    """A few AdamW steps of a tiny Llama with FP8 block linears: finite losses that fall and stay
    near the same run without FP8."""
    cfg = build_config(overrides=["--model.preset", "tiny-llama", "--num-layers", "2"]).model
    cfg = dataclasses.replace(cfg, hidden_size=64, ffn_hidden_size=128)
    losses = {}
    for side in ("plain", "fp8"):
        torch.manual_seed(0)
        model = build_model(cfg, 128, 32)
        if side == "fp8":
            fp8.apply_fp8(model.layers, Fp8Recipe("hybrid", recipe, amax_history_len=4, amax_compute_algo="max"), "meshtron")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        tokens, losses[side] = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1)), []
        for _ in range(6):  # one batch again and again: the loss must fall
            loss = model(tokens, labels=torch.roll(tokens, -1, 1)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[side].append(loss.item())
    plain, low = torch.tensor(losses["plain"]), torch.tensor(losses["fp8"])
    assert torch.isfinite(low).all() and low[-1] < low[0]
    assert ((low - plain).abs() / plain).max() < 0.02, (losses, recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_weight_gradients_go_into_main_grad(recipe):
    """Gradient-accumulation fusion on an FP8 linear: over three micro batches the fp32
    ``main_grad`` holds the sum the hook's path accumulates (the same FP8 GEMMs). The step's first
    is the GEMM's fp32 output (tensor-wise scales), which rounds to exactly the hook path's bf16
    product."""
    from meshtron.kernels.grad_accum_fusion import apply_gradient_accumulation_fusion
    from meshtron.optim.grad_buffer import GradBuffer

    gen = torch.Generator().manual_seed(5)
    xs = [_rand(32, 64, gen=gen, dtype=torch.bfloat16) for _ in range(3)]
    gs = [_rand(32, 48, gen=gen, dtype=torch.bfloat16) for _ in range(3)]
    main_grads, firsts = {}, {}
    for fuse in (False, True):
        layer = nn.Linear(64, 48, bias=False).to(torch.bfloat16)
        layer.weight.data.copy_(_rand(48, 64, gen=torch.Generator().manual_seed(6), scale=0.05))
        model = nn.Sequential(layer)
        fp8.apply_fp8(model, Fp8Recipe("hybrid", recipe), "meshtron")
        if fuse:
            apply_gradient_accumulation_fusion(model)
        buffer = GradBuffer(list(model.named_parameters()))
        for i, (x, g) in enumerate(zip(xs, gs)):
            model(x.clone().requires_grad_()).backward(g)
            if i == 0:
                firsts[fuse] = model[0].weight.main_grad.clone()
        main_grads[fuse] = model[0].weight.main_grad.clone()
        assert buffer.data.dtype == torch.float32
    # the same FP8 operands on both paths: the sums differ only by the hook path's bf16 rounding of each product
    assert (main_grads[True] - main_grads[False]).norm() / main_grads[False].norm() < 4e-3
    assert torch.equal(firsts[False], firsts[False].bfloat16().float())  # the hook's path: a bf16 product
    if recipe != "rowwise":  # tensor-wise scales: the fused first product is the GEMM's fp32 output
        assert not torch.equal(firsts[True], firsts[True].bfloat16().float())
        torch.testing.assert_close(firsts[True].bfloat16().float(), firsts[False], rtol=0, atol=0)


def test_linear_falls_back_where_shapes_do_not_fit():
    x, w = torch.randn(3, 5, 24), torch.randn(40, 24)  # 15 tokens, 40 features: not multiples of 16
    assert torch.equal(fp8.linear(x, w, None, Fp8Scaling(Fp8Recipe())), torch.nn.functional.linear(x, w))
    assert torch.equal(fp8.linear(x, w, None, None), torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="fp8 format"):
        grad_dtype("e5m2")
    assert grad_dtype("hybrid") == torch.float8_e5m2 and grad_dtype("hybrid", "fnuz") == torch.float8_e5m2fnuz
    with pytest.raises(ValueError, match="FP8 family"):
        Fp8Scaling(Fp8Recipe(), family="e4m3")


@pytest.mark.parametrize("recipe", RECIPES)
def test_parallel_linears_run_the_same_function(recipe):
    """One-rank parallel linears given an ``fp8`` state compute what ``Fp8Linear`` computes."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 32, generator=gen), torch.randn(48, 32, generator=gen)
    column, row = ColumnParallelLinear(32, 48, False, None), RowParallelLinear(32, 48, False, None)
    fp8.apply_fp8(nn.Sequential(column, row), Fp8Recipe("hybrid", recipe), "meshtron")
    assert column.fp8.recipe.recipe == row.fp8.recipe.recipe == recipe
    for layer in (column, row):
        layer.weight.data.copy_(w)
        torch.testing.assert_close(layer(x), fp8.linear(x, w, None, Fp8Scaling(Fp8Recipe("hybrid", recipe))))


def test_fp8_config_and_early_refusals():
    with pytest.raises(ValueError, match="needs a GPU with FP8"):
        fp8.check_fp8_device(torch.device("cpu"))
    with pytest.raises(ConfigError, match="need a GPU"):
        validate(build_config(overrides=["--fp8-format", "hybrid", "--device", "cpu"]))
    with pytest.raises(ConfigError, match="--fp8-format must be"):
        validate(build_config(overrides=["--fp8-format", "e5m2"]))
    for flags, message in [(["--fp8-recipe", "mxfp8"], "MXFP8 .* is not implemented"),
                           (["--fp8-recipe", "rowwize"], "unknown recipe"),
                           (["--fp8-amax-compute-algo", "mean"], "most_recent or max"),
                           (["--fp8-amax-history-len", "0"], "at least 1"),
                           (["--fp8-format", "hybrid", "--fp8-backend", "torchao"], "--fp8-recipe tensorwise")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            validate(build_config(overrides=flags))
    cfg = build_config(overrides=["--fp8-format", "hybrid", "--compile", "--gemm-tuning"])
    m = cfg.model
    assert (m.fp8_format, m.fp8_recipe, m.fp8_amax_history_len, m.fp8_amax_compute_algo, m.fp8_margin) == ("hybrid", "delayed", 1, "most_recent", 0)
    m = build_config(overrides=["--fp8-recipe=delayed", "--fp8-margin=1", "--fp8-interval=1", "--fp8-amax-history-len=1024",
                                "--fp8-amax-compute-algo=max"]).model  # fmt: skip
    assert (m.fp8_recipe, m.fp8_amax_history_len, m.fp8_amax_compute_algo, m.fp8_margin) == ("delayed", 1024, "max", 1)


@pytest.mark.parametrize("fields", [{"recompute_granularity": "full"}, {"recompute_granularity": "full", "recompute_num_layers": 2},
                                    {"moe_layer_recompute": True, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64,
                                     "moe_shared_expert_intermediate_size": 64, "add_bias_linear": False}])  # fmt: skip
def test_delayed_scaling_under_recompute_equals_the_run_that_keeps_activations(fields):
    """The rerun casts with the scales its forward used (the snapshot of the histories), and the
    histories move as without recompute: same losses, gradients and histories over steps."""
    base = dataclasses.replace(build_config(overrides=["--model.preset", "tiny-llama", "--num-layers", "2"]).model,
                               hidden_size=64, ffn_hidden_size=128)  # fmt: skip
    runs = {}
    model_fields = {k: v for k, v in fields.items() if "recompute" not in k}
    for side, extra in (("plain", model_fields), ("recompute", fields)):
        cfg = dataclasses.replace(base, **extra)
        torch.manual_seed(0)
        model = build_model(cfg, 128, 32)
        fp8.apply_fp8(model.layers, Fp8Recipe("hybrid", "delayed", amax_history_len=4, amax_compute_algo="max"), "meshtron")
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        tokens, losses = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1)), []
        for _ in range(4):  # the histories hold other amaxes at each step
            loss = model(tokens, labels=torch.roll(tokens, -1, 1)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        histories = [m.amax_history.clone() for m in model.modules() if isinstance(m, Fp8Scaling)]
        runs[side] = (torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}, histories)
    (plain_losses, plain_weights, plain_hist), (losses, weights, hist) = runs["plain"], runs["recompute"]
    assert torch.equal(losses, plain_losses)
    assert all(torch.equal(weights[n], w) for n, w in plain_weights.items())
    assert all(torch.equal(a, b) for a, b in zip(hist, plain_hist, strict=True)) and plain_hist


def test_eager_casts_skip_the_custom_op_layer():
    """Outside torch.compile the FP8 casts run their functions directly (the custom-op layer doubled
    their host time); meta tensors still go through the ops' registered shapes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshtron.kernels.fp8_scaling import _delayed_cast

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    scaling = Fp8Scaling(Fp8Recipe("hybrid", "delayed"))
    with Log():
        scaling.quantize(torch.randn(16, 32), "input", True, True, seeded=False, update=True)
    assert seen and not any("meshtron" in op for op in seen), seen
    t, history = torch.empty(16, 32, device="meta"), torch.zeros(1, device="meta")
    q, qt, inv = _delayed_cast(t, history, torch.float8_e4m3fn, 0, False, True, True, True, True, "off")
    assert q.shape == (16, 32) and qt.shape == (32, 16) and q.is_meta
