"""FP8 on the GPU: the Triton cast(+transpose) kernel bit-equal to the reference cast at a block's
shape; each recipe's three ``_scaled_mm`` GEMMs in bf16 against the fp32 simulation of the same
quantized operands, and their distance from the plain GEMMs; the cast kernel's speed. In the
platform's FP8 family (OCP on NVIDIA and gfx950, fnuz on gfx942); skipped where FP8 is refused.
Also the FP8 weight copies made once a step of several micro batches against once per micro batch."""

import contextlib

import pytest
import torch

from meshtron.kernels import fp8, platform
from meshtron.kernels.fp8_cast import fp8_cast
from meshtron.kernels.fp8_scaling import FP8_FAMILIES, FP8_FORMATS, FP8_RECIPES, Fp8Recipe, Fp8Scaling, grad_dtype, platform_family
from tests.unit.test_fp8_output import _CountScaledMm  # counts the _scaled_mm calls

FAMILY = platform_family() if torch.cuda.is_available() else "ocp"
E4M3, E5M2 = FP8_FAMILIES[FAMILY]
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and platform.fp8_refusal(torch.device("cuda")) is not None, reason="no FP8 on this GPU"
)


def _simulated(t, dtype, dim=None):
    """What the GEMM sees of ``t`` under current scaling (over ``dim``, all of it when None), in fp32."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
    scale = fmax / amax.float().clamp(min=1e-12)
    return (t.float() * scale).to(t.dtype).clamp(-fmax, fmax).to(dtype).float() / scale


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_cast_kernel_gpu(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = (torch.randn(8192, 2048 + 48, device="cuda", generator=gen) * 3).bfloat16()  # a ragged last tile
    fmax, amax = torch.finfo(dtype).max, t.float().abs()
    for scale in (fmax / amax.max(), 4 * fmax / amax.max(), fmax / amax.amax(1, keepdim=True), fmax / amax.amax(0, keepdim=True)):
        fast, ref = (fp8_cast(t, scale, dtype, True, True, True, mode) for mode in ("on", "off"))
        assert torch.equal(fast.rows.view(torch.uint8), ref.rows.view(torch.uint8))
        assert torch.equal(fast.transposed.view(torch.uint8), ref.transposed.view(torch.uint8))
        assert fast.amax.item() == ref.amax.item()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for mode in ("on", "off"):
        fp8_cast(t, scale, dtype, True, True, True, mode)
        start.record()
        for _ in range(20):
            fp8_cast(t, scale, dtype, True, True, True, mode)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 20
        print(f"fp8 cast+transpose+amax {tuple(t.shape)} {dtype} {mode}: {ms:.3f} ms, {4 * t.numel() / ms / 1e6:.0f} GB/s")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [r for r in FP8_RECIPES if r != "blockwise"])  # blockwise: test_fp8_blockwise_gpu.py
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fp8_linear_gpu(recipe, fmt):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(8192, 2048, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    g = torch.randn(4096, 8192, device="cuda", generator=gen).bfloat16()
    y = fp8.linear(x, w, None, Fp8Scaling(Fp8Recipe(fmt, recipe), "cuda"))  # first call: current scaling
    y.backward(g)
    gd = E4M3 if recipe == "rowwise" else grad_dtype(fmt, FAMILY)
    row, col = (1, 0) if recipe == "rowwise" else (None, None)
    xd, wd = x.detach(), w.detach()
    sim = [_simulated(xd, E4M3, row) @ _simulated(wd, E4M3, row).T, _simulated(g, gd, row) @ _simulated(wd, E4M3, col),
           _simulated(g, gd, col).T @ _simulated(xd, E4M3, col)]  # fmt: skip
    exact = [xd.float() @ wd.float().T, g.float() @ wd.float(), g.float().T @ xd.float()]
    for name, got, s, e in zip(("forward", "grad_input", "grad_weight"), (y.detach(), x.grad, w.grad), sim, exact):
        print(f"fp8 {fmt} {recipe} {name}: vs simulation {_rel(got, s):.2e}, vs fp32 GEMM {_rel(got, e):.2e}")
        assert _rel(got, s) < 1e-2 and _rel(got, e) < 0.08


def _fp8_output_simulation(hidden, weight, labels, mask, fmt, fp8_rows):
    """The FP8 output layer's loss and gradients (of the loss's sum) in fp32 from the operands it
    quantizes: hidden and weight at their amaxes (a first call), each ``(softmax - onehot) * w / n``
    at ``fmax / max|w / n|``; the weight's rows from ``fp8_rows`` on (a chunk too narrow) unquantized."""
    n, gd = hidden.shape[0], grad_dtype(fmt, FAMILY)
    hq, wq = _simulated(hidden, E4M3), _simulated(weight, E4M3)  # the weight's amax over all its rows, as cast
    logits = torch.cat([hq @ wq[:fp8_rows].T, hidden.float() @ weight[fp8_rows:].float().T], 1).bfloat16().float()
    weights = torch.where(labels == -100, 0.0, mask)
    lse = torch.logsumexp(logits, 1)
    total = ((lse - logits.gather(1, labels.clamp(min=0)[:, None])[:, 0]) * weights).sum()
    onehot = torch.zeros_like(logits).scatter_(1, labels.clamp(min=0)[:, None], (labels != -100).float()[:, None])
    dlogits = (((logits - lse[:, None]).exp() - onehot) * (weights / n)[:, None]).bfloat16()
    fmax = torch.finfo(gd).max
    scale = fmax / (weights / n).abs().max()
    dq = (dlogits.float() * scale).bfloat16().clamp(-fmax, fmax).to(gd).float() / scale
    dq[:, fp8_rows:] = dlogits[:, fp8_rows:].float()
    grad_hidden = dq[:, :fp8_rows] @ wq[:fp8_rows] + dq[:, fp8_rows:] @ weight[fp8_rows:].float()
    grad_weight = torch.cat([dq[:, :fp8_rows].T @ hq, dq[:, fp8_rows:].T @ hidden.float()])
    return total, grad_hidden * n, grad_weight * n


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("budget", [4 * 2**30, 32 * 2**20])  # one token block; several (the fp32 weight-gradient sum)
def test_fp8_output_layer_gpu(recipe, budget):
    """``--fp8-output-layer``'s fused loss in bf16 on CUDA: 4 chunks of 8192 rows in FP8 and a last
    one 8 rows short of a multiple of 16 in bf16; loss and gradients against the fp32 simulation of
    the quantized operands (1e-2) and the bf16 path (0.08), and the FP8 GEMMs ran (3 per FP8 chunk
    and token block)."""
    from meshtron.kernels.cross_entropy_sum import (
        block_tokens_for,
        linear_cross_entropy_sum,
    )

    tokens, hidden_size, vocab, chunk = 4096, 2048, 4 * 8192 + 24, 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.02).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    labels[:100] = -100
    mask = (torch.rand(tokens, device="cuda", generator=gen) > 0.1).float()
    scaling = Fp8Scaling(Fp8Recipe("hybrid", recipe), "cuda")

    def run(state):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        total = linear_cross_entropy_sum(h, w, labels, mask, chunk_size=chunk, budget_bytes=budget, fp8=state)
        total.backward()
        return total.detach(), h.grad, w.grad

    with _CountScaledMm() as counter:
        got = run(scaling)
    blocks = -(-tokens // (block_tokens_for(tokens, vocab, 2, budget) // 16 * 16))
    assert counter.count == 3 * 4 * blocks, "the FP8 output layer did not run _scaled_mm"
    sim = _fp8_output_simulation(hidden, weight, labels, mask, "hybrid", 4 * 8192)
    plain = run(None)
    for name, g, s, p in zip(("loss", "hidden grad", "weight grad"), got, sim, plain):
        print(f"fp8 output layer {recipe} {budget >> 20} MiB {name}: vs simulation {_rel(g, s):.2e}, vs bf16 path {_rel(g, p):.2e}")
        assert _rel(g, s) < 1e-2 and _rel(g, p) < 0.08, name


@pytest.mark.gpu
def test_fp8_output_layer_speed_b3_shape():
    """B3's output layer (8192 tokens, hidden 4096, vocabulary 128256, bf16): forward + backward of
    the fused loss with and without ``--fp8-output-layer`` (delayed scaling, seeded); FP8 is faster."""
    from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum
    from meshtron.planning.calibrate import cuda_seconds

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(8192, 4096, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(128256, 4096, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, 128256, (8192,), device="cuda", generator=gen)
    mask = torch.ones(8192, device="cuda")

    def step(scaling):
        return torch.autograd.grad(linear_cross_entropy_sum(hidden, weight, labels, mask, fp8=scaling), (hidden, weight))

    scalings = {"bf16": None, "fp8": Fp8Scaling(Fp8Recipe("hybrid", "delayed"), "cuda")}  # FP8's first (warm-up) call seeds the histories
    ms = {name: 1e3 * cuda_seconds(lambda scaling=scaling: step(scaling), repeat=5) for name, scaling in scalings.items()}
    print(f"output layer + loss at B3's shape: bf16 {ms['bf16']:.2f} ms, fp8 {ms['fp8']:.2f} ms ({ms['bf16'] - ms['fp8']:.2f} ms saved)")
    assert ms["fp8"] < ms["bf16"]


@pytest.mark.gpu
def test_fp8_weight_copies_once_a_step_gpu():
    """A step of 4 micro batches through 8 FP8 linears of Llama-3-8B's MLP shape (4 x (4096 -> 14336
    -> 4096), bf16, delayed scaling, 4096 tokens a micro batch) with the weights cast once for the
    step (``kernels/step_cache.py``'s scope, as the runner opens it) and cast per micro batch: the
    same outputs and gradients, bit for bit (the weights do not change, so delayed scaling reads the
    same scales either way); prints the step time of both."""
    from meshtron.kernels import step_cache

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 14336), (14336, 4096)] * 4
    weights = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16() for k, n in shapes]
    xs = [torch.randn(4096, 4096, device="cuda", generator=gen).bfloat16() for _ in range(4)]

    def build() -> torch.nn.Sequential:
        layers = torch.nn.Sequential(*(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for k, n in shapes))
        for layer, w in zip(layers, weights):
            layer.weight.data.copy_(w)
        fp8.apply_fp8(layers, Fp8Recipe("hybrid", "delayed"), "meshtron")
        return layers

    def step(layers, cached: bool):
        layers.zero_grad()
        outs, grads_x = [], []
        with step_cache.scope() if cached else contextlib.nullcontext():
            for x in xs:
                x = x.clone().requires_grad_()
                y = layers(x)
                y.float().square().mean().backward()
                outs.append(y.detach())
                grads_x.append(x.grad)
        return outs, grads_x, [layer.weight.grad.clone() for layer in layers]

    built = {cached: build() for cached in (False, True)}
    for cached, layers in built.items():
        for _ in range(2):  # warm-up; the first step seeds the histories
            step(layers, cached)
    times, results = {False: [], True: []}, {}
    for _ in range(5):  # alternated, so a drift of the GPU's clock reaches both alike
        for cached, layers in built.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            results[cached] = step(layers, cached)
            end.record()
            torch.cuda.synchronize()
            times[cached].append(start.elapsed_time(end))
    ms = {cached: sorted(t)[len(t) // 2] for cached, t in times.items()}
    elements = sum(k * n for k, n in shapes)
    print(f"4 micro batches through 8 FP8 linears ({elements / 1e6:.0f} M weight elements): weights cast per micro batch "
          f"{ms[False]:.2f} ms, once a step {ms[True]:.2f} ms ({ms[False] - ms[True]:.2f} ms saved)")  # fmt: skip
    for got, want in zip(results[True], results[False]):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
