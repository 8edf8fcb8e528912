"""The output layer's FP8 GEMMs (``--fp8-output-layer``, ``kernels/fp8_output.py``) on the CPU: the
fused masked-sum loss and its gradients against a float64 simulation of the same quantized operands,
and near the unquantized loss; delayed scaling's histories; the shapes that fall back; the static
bound of the gradient's scale; a tiny model trained with it; the flag's refusals."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.config import ConfigError, build_config
from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum
from meshtron.kernels.fp8 import apply_fp8
from meshtron.kernels.fp8_scaling import FP8_FORMATS, Fp8Recipe, Fp8Scaling, grad_dtype
from meshtron.models import build_model
from meshtron.parallel.setup import apply_fp8_output_layer
from meshtron.validation import validate

E4M3 = torch.float8_e4m3fn
N, HIDDEN, VOCAB = 48, 32, 320
# FP8 path vs its float64 simulation: fp32's summation order (2e-7 at most over 48 seeded cases), and
# now and then one FP8 rounding decided otherwise in fp32 than in float64 (2e-5 for one e5m2 step).
SIM_TOL = 1e-4
PLAIN_TOL = 0.07  # FP8 path vs the unquantized loss: e4m3 operands, e5m2 gradients (as tests/unit/test_fp8.py)


def _quantized(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """What a GEMM reads of ``t``, in float64: scaled in fp32, rounded to ``t``'s dtype, clamped, cast, scaled back."""
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).to(t.dtype).clamp(-fmax, fmax).to(dtype).double() / scale.double()


def _amax_scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.finfo(dtype).max / t.abs().amax().float()


def _simulated(hidden, weight, labels, mask, fmt, real, fp8_cols, scales=None):
    """Loss and the (hidden, weight) gradients of ``total`` in float64 from the operands the FP8 path
    quantizes: hidden and weight rows at their scales (``scales``; None: their amaxes), each chunk's
    ``(softmax - onehot) * w / n`` at ``fmax / max|w / n|``; columns outside ``fp8_cols`` unquantized."""
    n, gd = hidden.shape[0], grad_dtype(fmt)
    sh, sw = scales or (_amax_scale(hidden, E4M3), _amax_scale(weight[:real], E4M3))
    fp8 = torch.zeros(real, dtype=torch.bool)
    fp8[fp8_cols] = True
    hq, wq = _quantized(hidden, E4M3, sh), _quantized(weight[:real], E4M3, sw)
    h64, w64 = hidden.double(), weight[:real].double()
    logits = torch.where(fp8, hq @ wq.T, h64 @ w64.T).to(hidden.dtype).double()  # the GEMM writes the compute dtype
    kept = labels != -100
    weights = torch.where(kept, mask.double(), 0.0)
    lse = torch.logsumexp(logits, 1)
    target = logits.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    total = (torch.where(kept, lse - target, 0.0) * weights).sum()
    onehot = torch.zeros_like(logits).scatter_(1, labels.clamp(min=0)[:, None], kept.double()[:, None])
    dlogits = ((logits - lse[:, None]).exp() - onehot) * (weights / n)[:, None]
    dlogits = dlogits.to(hidden.dtype)  # chunk_backward writes the compute dtype
    gscale = torch.finfo(gd).max / (weights / n).abs().amax().float()
    dq = torch.where(fp8, _quantized(dlogits, gd, gscale), dlogits.double())
    grad_hidden = torch.where(fp8, dq, 0.0) @ wq + torch.where(fp8, 0.0, dq) @ w64
    grad_weight = torch.where(fp8, dq, 0.0).T @ hq + torch.where(fp8, 0.0, dq).T @ h64
    grad_weight = torch.cat([grad_weight, torch.zeros(weight.shape[0] - real, hidden.shape[1], dtype=torch.float64)])
    return total, grad_hidden * n, grad_weight * n


def _run(hidden, weight, labels, mask, fp8, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total = linear_cross_entropy_sum(h, w, labels, mask, "auto", fp8=fp8, **kw)
    total.backward()
    return total.detach(), h.grad, w.grad


def _problem(seed=0, dtype=torch.float32, n=N):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3).to(dtype)
    labels = torch.randint(0, VOCAB - 40, (n,), generator=gen)
    labels[5:9] = -100
    mask = (torch.rand(n, generator=gen) > 0.2).float() * (1 + torch.rand(n, generator=gen))  # zeros and non-unit weights
    return hidden, weight, labels, mask


def _rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


# (chunk, budget, real rows, the columns in FP8): whole chunks; the last chunk 44 wide (bf16) with
# padded rows; three token blocks of 16 (a 16-row budget) and chunks of 96 (the last 32 wide).
CASES = [(64, 2**30, VOCAB, slice(0, VOCAB)), (64, 2**30, VOCAB - 20, slice(0, 256)), (96, 16 * VOCAB * 4, VOCAB, slice(0, VOCAB))]


@pytest.mark.parametrize("chunk, budget, real, fp8_cols", CASES)
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fp8_loss_and_grads_equal_simulation(chunk, budget, real, fp8_cols, recipe, fmt):
    """Loss, hidden and weight gradients equal the float64 simulation of the quantized operands
    (``SIM_TOL``) and lie within ``PLAIN_TOL`` of the unquantized loss, which is 100x further off:
    FP8 ran. Padded rows get no gradient."""
    hidden, weight, labels, mask = _problem()
    scaling = Fp8Scaling(Fp8Recipe(fmt, recipe))
    got = _run(hidden, weight, labels, mask, scaling, chunk_size=chunk, budget_bytes=budget, real_rows=real)
    sim = _simulated(hidden, weight, labels, mask, fmt, real, fp8_cols)
    plain = _run(hidden, weight, labels, mask, None, chunk_size=chunk, budget_bytes=budget, real_rows=real)
    for name, g, s, p in zip(("loss", "hidden grad", "weight grad"), got, sim, plain):
        assert _rel(g, s) < SIM_TOL, f"{name}: {_rel(g, s):.2e} from the simulation"
        assert _rel(g, p) < PLAIN_TOL, f"{name}: {_rel(g, p):.2e} from the unquantized loss"
        assert _rel(g, p) > 100 * max(_rel(g, s), 1e-9), f"{name}: the FP8 path did not quantize"
    assert not got[2][real:].any()


def test_bf16_operands_near_simulation():
    """bf16 hidden states and weight (the training dtype): the logits GEMM rounds to bf16, the
    gradients sum in fp32 and are rounded once; within bf16's rounding of the simulation."""
    hidden, weight, labels, mask = _problem(dtype=torch.bfloat16)
    got = _run(hidden, weight, labels, mask, Fp8Scaling(Fp8Recipe("hybrid", "tensorwise")), chunk_size=64)
    sim = _simulated(hidden, weight, labels, mask, "hybrid", VOCAB, slice(0, VOCAB))
    for name, g, s in zip(("loss", "hidden grad", "weight grad"), got, sim):
        assert g.dtype == (torch.float32 if name == "loss" else torch.bfloat16)
        assert _rel(g, s) < 1e-2, f"{name}: {_rel(g, s):.2e}"


def test_delayed_scaling_reads_the_history_and_leaves_the_gradient_row():
    """The second call casts the hidden states and the weight at the first call's amaxes (the
    history), then pushes its own; the gradient's scale is static, so its history row stays 0."""
    hidden, weight, labels, mask = _problem()
    scaling = Fp8Scaling(Fp8Recipe("hybrid", "delayed", amax_history_len=2))
    _run(hidden, weight, labels, mask, scaling, chunk_size=64)
    assert scaling.seeded
    hidden2 = hidden * 3  # past the history's amax: saturates at e4m3's maximum
    got = _run(hidden2, weight, labels, mask, scaling, chunk_size=64)
    scales = (_amax_scale(hidden, E4M3), _amax_scale(weight, E4M3))
    sim = _simulated(hidden2, weight, labels, mask, "hybrid", VOCAB, slice(0, VOCAB), scales)
    for name, g, s in zip(("loss", "hidden grad", "weight grad"), got, sim):
        assert _rel(g, s) < SIM_TOL, f"{name}: {_rel(g, s):.2e}"
    want = torch.tensor([[hidden2.abs().max(), hidden.abs().max()], [weight.abs().max()] * 2, [0.0, 0.0]])
    torch.testing.assert_close(scaling.amax_history, want)


def test_gradient_scale_is_the_static_bound(monkeypatch):
    """Each chunk's gradient is cast at ``fmax / max|w / n|`` (no amax pass): no element exceeds the
    format's maximum (the bound holds), and with targets given probability ~0 the largest reaches it
    (the scale wastes no range)."""
    from meshtron.kernels import fp8_output

    hidden, weight, labels, mask = _problem()
    hidden *= 20  # logits spread wide: a target not the largest gets probability ~0
    casts, cast = [], fp8_output.fp8_cast
    monkeypatch.setattr(fp8_output, "fp8_cast", lambda t, scale, *a, **k: casts.append((t.clone(), scale)) or cast(t, scale, *a, **k))
    _run(hidden, weight, labels, mask, Fp8Scaling(Fp8Recipe("hybrid", "tensorwise")), chunk_size=64)
    fmax, weights = torch.finfo(torch.float8_e5m2).max, torch.where(labels == -100, 0.0, mask)
    assert len(casts) == 5
    for dlogits, scale in casts:
        torch.testing.assert_close(scale, fmax / (weights / N).max())
        assert (dlogits.abs().max() * scale).item() <= fmax * (1 + 1e-6)
    assert max((d.abs().max() * s).item() for d, s in casts) > 0.99 * fmax


class _CountScaledMm(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket == torch.ops.aten._scaled_mm
        return func(*args, **(kwargs or {}))


def test_fp8_runs_three_scaled_gemms_per_chunk_and_falls_back_where_shapes_do_not_fit():
    """5 chunks of 64: 15 ``_scaled_mm`` calls; 40 tokens (not a multiple of 16) or evaluation (no
    grad): none, bit-equal to the path without FP8; a bias or a per-row recipe is refused."""
    hidden, weight, labels, mask = _problem()
    scaling = Fp8Scaling(Fp8Recipe("hybrid", "tensorwise"))
    with _CountScaledMm() as counter:
        _run(hidden, weight, labels, mask, scaling, chunk_size=64)
    assert counter.count == 3 * 5
    hidden, weight, labels, mask = _problem(n=40)
    with _CountScaledMm() as counter:
        got = _run(hidden, weight, labels, mask, scaling, chunk_size=64)
    assert counter.count == 0
    for g, w in zip(got, _run(hidden, weight, labels, mask, None, chunk_size=64)):
        assert torch.equal(g, w)
    history = Fp8Scaling(Fp8Recipe("hybrid", "delayed"))
    with torch.no_grad(), _CountScaledMm() as counter:
        total = linear_cross_entropy_sum(hidden, weight, labels, mask, "auto", fp8=history)
    assert counter.count == 0 and not history.seeded and not history.amax_history.any()
    assert torch.equal(total, linear_cross_entropy_sum(hidden, weight, labels, mask, "auto"))
    with pytest.raises(ValueError, match="takes no bias"):
        linear_cross_entropy_sum(hidden, weight, labels, mask, "auto", bias=torch.zeros(VOCAB), fp8=scaling)
    with pytest.raises(ValueError, match="delayed or tensorwise"):
        _run(*_problem(), Fp8Scaling(Fp8Recipe("hybrid", "rowwise")))


def test_tiny_model_trains_with_fp8_output_layer():
    """A tiny Llama (FP8 blocks) trained a few steps through the contract's masked-sum loss: with
    the FP8 output layer its losses fall and stay within 2 % of the bf16 output layer's, and the
    head's GEMMs ran in FP8 (its scaling state seeded, its weight amax in the history)."""
    cfg = build_config(overrides=["--model.preset", "tiny-llama", "--num-layers", "2"]).model
    cfg = dataclasses.replace(cfg, hidden_size=64, ffn_hidden_size=128, tie_embeddings=False)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (4, 32), generator=gen)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": (torch.rand(4, 32, generator=gen) > 0.1).float()}
    recipe = Fp8Recipe("hybrid", "delayed", amax_history_len=4, amax_compute_algo="max")
    losses = {}
    for side in ("bf16 head", "fp8 head"):
        torch.manual_seed(0)
        model = build_model(cfg, 128, 32)
        apply_fp8(model.layers, recipe, "meshtron")
        heads = apply_fp8_output_layer(model, recipe, None) if side == "fp8 head" else []
        opt, losses[side] = torch.optim.AdamW(model.parameters(), lr=3e-3), []
        for _ in range(6):
            out, _ = model.run_stage(None, batch, list(model.layers), True, True)
            loss = model.loss(batch, out)
            opt.zero_grad()
            (loss.total / loss.count).backward()
            opt.step()
            losses[side].append((loss.total / loss.count).item())
    assert len(heads) == 1 and heads[0] is model.output and heads[0].fp8.seeded
    assert heads[0].fp8.amax_history[1].max() > 0 and not heads[0].fp8.amax_history[2].any()
    plain, low = torch.tensor(losses["bf16 head"]), torch.tensor(losses["fp8 head"])
    assert torch.isfinite(low).all() and low[-1] < low[0]
    assert ((low - plain).abs() / plain).max() < 0.02, losses
    assert not torch.equal(low, plain)


def test_bias_head_keeps_bf16():
    cfg = build_config(overrides=["--model-type", "bert", "--preset", "tiny-bert", "--num-layers", "2", "--hidden-size", "32"]).model
    model = build_model(cfg, 96, 16)
    assert apply_fp8_output_layer(model, Fp8Recipe(), None) == [] and model.output.fp8 is None


def test_flag_and_refusals():
    """The flag parses; it needs --fp8-format and a per-tensor recipe (rowwise and blockwise are
    refused by name, before any GPU), and the fused loss; with --fp8-backend auto or torchao it stands."""
    assert not build_config().model.fp8_output_layer
    gpu = ["--device", "cuda", "--fp8-output-layer"]
    validate(build_config(overrides=[*gpu, "--fp8-format", "hybrid"]))
    validate(build_config(overrides=[*gpu, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-backend", "torchao"]))
    for flags, message in [([], "--fp8-output-layer needs --fp8-format"),
                           (["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"], "--fp8-output-layer takes one scale per tensor.*not rowwise"),
                           (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], "--fp8-output-layer takes one scale per tensor.*not blockwise"),
                           (["--fp8-format", "hybrid", "--no-fused-kernels"], "inside the fused masked-sum loss"),
                           (["--fp8-format", "hybrid", "--no-cross-entropy-loss-fusion"], "inside the fused masked-sum loss")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            validate(build_config(overrides=[*gpu, *flags]))


@pytest.mark.parametrize("tied", [False, True])
def test_training_setup_gives_the_head_its_state(monkeypatch, tied):
    """``build_runner`` (the FP8 device check bypassed: the CPU's ``_scaled_mm`` stands in) gives the
    output layer its FP8 state beside the FP8 blocks, with ``--fp8-backend auto`` and gradient-
    accumulation fusion: two micro batches train through it, the head's weight gradient (into
    ``main_grad`` when untied; the embedding's when tied) within ``PLAIN_TOL`` of the bf16 head's."""
    from meshtron.parallel import setup
    from meshtron.parallel.mesh import Mesh

    monkeypatch.setattr(setup, "check_fp8_device", lambda device: None)
    g = torch.Generator().manual_seed(7)
    batches = [{"tokens": torch.randint(0, 128, (2, 32), generator=g), "labels": torch.randint(0, 128, (2, 32), generator=g),
                "loss_mask": (torch.rand(2, 32, generator=g) > 0.1).float()} for _ in range(2)]  # fmt: skip
    grads = {}
    for flag in ([], ["--fp8-output-layer"]):
        cfg = build_config(overrides=["--model.preset", "tiny-llama", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
                                      "--vocab-size", "128", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
                                      "--fp8-format", "hybrid", "--fp8-backend", "auto", "--gradient-accumulation-fusion",
                                      *([] if tied else ["--untie-embeddings-and-output-weights"]), *flag])  # fmt: skip
        torch.manual_seed(0)
        runner = setup.build_runner(cfg, Mesh.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0), 128, torch.device("cpu"), torch.float32)
        head = runner.model.output
        runner.optimizer.zero_grad()
        runner.forward_backward(batches)
        runner.finalize_grads()
        weight = runner.model.embedding.weight if tied else head.weight
        grads[bool(flag)] = weight.main_grad.clone()
        assert (head.fp8 is not None and head.fp8.seeded) == bool(flag)
    assert _rel(grads[True], grads[False]) < PLAIN_TOL and not torch.equal(grads[True], grads[False])


def test_estimate_counts_the_fp8_copies():
    """``meshtron estimate`` adds the call's FP8 copies to the loss workspace with the flag: the
    hidden states' and weight's copies are those a call makes (their bytes counted here), plus a
    chunk's gradient copies; at B3 (Llama-3-8B's head, 8192 tokens) 1.67 GiB."""
    from meshtron.estimate import fp8_output_bytes, loss_bytes
    from meshtron.kernels.fp8_output import Fp8OutputGemms

    hidden, weight, _, mask = _problem()
    gemms = Fp8OutputGemms(Fp8Scaling(Fp8Recipe()), hidden, weight, mask / N, True, True)
    copies = sum(t.numel() * t.element_size() for q in (gemms.h, gemms.w) for t in (q.rows, q.transposed))
    chunk = VOCAB  # default_chunk_size at 48 tokens: the whole vocabulary
    assert fp8_output_bytes(N, VOCAB, HIDDEN, 4) == copies + 2 * N * chunk + HIDDEN * chunk
    b3 = ["--preset", "llama3-8b", "--num-layers", "8", "--seq-length", "8192", "--micro-batch-size", "1", "--global-batch-size", "1",
          "--bf16", "--fp8-format", "hybrid"]  # fmt: skip
    added = loss_bytes(build_config(overrides=[*b3, "--fp8-output-layer"])) - loss_bytes(build_config(overrides=b3))
    assert added == fp8_output_bytes(8192, 128256, 4096, 2) and round(added / 2**30, 2) == 1.67
