"""FP8 linears cast their weights once a step of several micro batches (``kernels/fp8.py``'s
``_weight_copies`` in ``kernels/step_cache.py``'s scope), on the CPU: the same outputs, gradients
and histories as casting per micro batch (delayed scaling: where the two must agree), one cast a
step, evaluation forwards, tensor-parallel linears, full recompute, and the estimate's term."""

import contextlib
import dataclasses

import pytest
import torch
from torch import nn

from meshtron.config import build_config
from meshtron.estimate import estimate, first_stage_blocks, fp8_weight_copy_bytes
from meshtron.kernels import fp8, step_cache
from meshtron.kernels.fp8_scaling import FP8_RECIPES, ROLES, Fp8Recipe, Fp8Scaling
from meshtron.models import build_model
from meshtron.parallel.sizes import rank_parameters
from meshtron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

MICRO = 3


def _recipe(recipe: str, **fields) -> Fp8Recipe:
    return Fp8Recipe("e4m3" if recipe == "blockwise" else "hybrid", recipe, **fields)  # blockwise is all e4m3


def _count_weight_casts(scaling: Fp8Scaling) -> list[tuple[bool, torch.Tensor]]:
    """Record (transposed layout made, inverse scale) of each weight cast of ``scaling``."""
    casts, quantize = [], scaling.quantize

    def counted(t, role, rows, transposed, seeded, update):
        q = quantize(t, role, rows, transposed, seeded, update)
        if role == "weight":
            casts.append((transposed, q.rows_inv.clone()))
        return q

    scaling.quantize = counted
    return casts


def _two_steps(recipe: str, cached: bool) -> dict:
    """One 128 -> 256 FP8 linear over two steps of ``MICRO`` micro batches (an SGD update between
    them that moves the weight's amax), each step in a ``step_cache`` scope when ``cached``."""
    gen = torch.Generator().manual_seed(7)
    layer = nn.Sequential(nn.Linear(128, 256, bias=False))
    layer[0].weight.data.copy_(torch.randn(256, 128, generator=gen) * 0.05)
    fp8.apply_fp8(layer, _recipe(recipe, amax_history_len=4), "meshtron")
    layer = layer[0]
    casts = _count_weight_casts(layer.fp8)
    out = {"y": [], "dx": [], "dw": [], "amax": [], "history": []}
    for _ in range(2):
        out["amax"].append(layer.weight.detach().abs().max())
        with step_cache.scope() if cached else contextlib.nullcontext():
            for _ in range(MICRO):
                x = torch.randn(128, 128, generator=gen).requires_grad_()
                y = layer(x)
                y.backward(torch.randn(128, 256, generator=gen))
                out["y"].append(y.detach())
                out["dx"].append(x.grad)
        out["dw"].append(layer.weight.grad.clone())
        out["history"].append(layer.fp8.amax_history.clone())
        with torch.no_grad():
            layer.weight -= 1e-4 * layer.weight.grad  # the amax moves by about 1 %
        layer.weight.grad = None
    out["casts"] = casts
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_a_step_casts_each_weight_once_and_computes_what_casting_per_micro_batch_does(recipe):
    """tensorwise, rowwise, blockwise: the weight's copies are a function of the weight, so the
    cached step is bit-equal to casting per micro batch (outputs, input and weight gradients),
    across an update. delayed: bit-equal in the first step (its later micro batches scale from the
    amax the first pushed: the weight's own); after the update the step's copies keep the scale
    the first micro batch reads (where casting anew rescales later micro batches from the moved
    amax: the outputs differ by FP8 rounding), and the weight's history row gets one entry a step."""
    cached, plain = _two_steps(recipe, cached=True), _two_steps(recipe, cached=False)
    assert len(cached["casts"]) == 2 and len(plain["casts"]) == 2 * MICRO
    assert all(transposed for transposed, _ in cached["casts"])  # both layouts, for the whole step
    assert _equal(cached["dw"], plain["dw"])  # g^T x reads no weight copy: equal in every recipe
    if recipe != "delayed":
        assert _equal(cached["y"], plain["y"]) and _equal(cached["dx"], plain["dx"])
        return
    first = slice(0, MICRO + 1)  # the first step, and the second step's first micro batch
    assert _equal(cached["y"][first], plain["y"][first]) and _equal(cached["dx"][first], plain["dx"][first])
    (_, step2_scale), (_, plain_mb1), (_, plain_mb2) = cached["casts"][1], *plain["casts"][MICRO : MICRO + 2]
    assert torch.equal(step2_scale, plain_mb1)  # the scale the uncached first micro batch used
    assert not torch.equal(plain_mb1, plain_mb2)  # the update moved the amax: the two paths differ from here
    for got, want in zip(cached["y"][MICRO + 1 :], plain["y"][MICRO + 1 :]):
        assert (got - want).norm() / want.norm() < 0.03  # another scale: elements move by e4m3 steps
    a1, a2 = cached["amax"]
    w = ROLES.index("weight")
    others = [i for i in range(len(ROLES)) if i != w]
    assert torch.equal(cached["history"][1][others], plain["history"][1][others])
    assert torch.equal(cached["history"][1][w], torch.stack([a2, a1, torch.zeros(()), torch.zeros(())]))
    assert torch.equal(plain["history"][1][w], torch.stack([a2, a2, a2, a1]))


def test_an_evaluation_forward_casts_its_own_copy_and_leaves_none():
    """A forward without grad in a scope casts only the row-major copy it needs and keeps nothing;
    the next forward with grad still makes (and keeps) both layouts, which backward reads."""
    gen = torch.Generator().manual_seed(3)
    layer = nn.Sequential(nn.Linear(64, 32, bias=False))
    fp8.apply_fp8(layer, Fp8Recipe("hybrid", "tensorwise"), "meshtron")
    casts = _count_weight_casts(layer[0].fp8)
    x = torch.randn(16, 64, generator=gen)
    with step_cache.scope():
        with torch.no_grad():
            layer(x)
        for _ in range(2):
            layer(x.clone().requires_grad_()).sum().backward()
        with torch.no_grad():
            layer(x)
    assert [transposed for transposed, _ in casts] == [False, True, False]


def test_tensor_parallel_linears_key_the_cache_on_their_parameter():
    """One-rank column and row parallel linears: one cast per weight a step, the same outputs and
    gradients as casting per micro batch."""
    gen = torch.Generator().manual_seed(4)
    xs, w1, w2 = [torch.randn(16, 32, generator=gen) for _ in range(MICRO)], torch.randn(48, 32, generator=gen), torch.randn(32, 48, generator=gen)
    runs = {}
    for cached in (True, False):
        column, row = ColumnParallelLinear(32, 48, False, None), RowParallelLinear(48, 32, False, None)
        fp8.apply_fp8(nn.Sequential(column, row), Fp8Recipe("hybrid", "delayed"), "meshtron")
        column.weight.data.copy_(w1)
        row.weight.data.copy_(w2)
        casts = [_count_weight_casts(layer.fp8) for layer in (column, row)]
        with step_cache.scope() if cached else contextlib.nullcontext():
            ys = [row(column(x)) for x in xs]
            for y in ys:
                y.sum().backward()
        runs[cached] = ys, [column.weight.grad, row.weight.grad], [len(c) for c in casts]
    assert runs[True][2] == [1, 1] and runs[False][2] == [MICRO, MICRO]
    assert _equal(runs[True][0], runs[False][0]) and _equal(runs[True][1], runs[False][1])


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_full_recompute_reads_the_steps_copies(recipe):
    """A tiny Llama over steps of three micro batches in a scope: under full recompute the rerun
    forwards read the step's copies (one cast per weight a step), and losses, weights and histories
    equal the run that keeps its activations; tensorwise also equals that run casting per micro batch."""
    base = dataclasses.replace(build_config(overrides=["--model.preset", "tiny-llama", "--num-layers", "2"]).model,
                               hidden_size=64, ffn_hidden_size=128)  # fmt: skip
    tokens = torch.randint(0, 128, (2 * MICRO, 32), generator=torch.Generator().manual_seed(1))
    runs = {}
    for side, recompute, cached in (("plain", "", True), ("recompute", "full", True), ("uncached", "", False)):
        torch.manual_seed(0)
        model = build_model(dataclasses.replace(base, recompute_granularity=recompute), 128, 32)
        fp8.apply_fp8(model.layers, Fp8Recipe("hybrid", recipe, amax_history_len=4, amax_compute_algo="max"), "meshtron")
        scalings = [m for m in model.modules() if isinstance(m, Fp8Scaling)]
        casts = [_count_weight_casts(s) for s in scalings]
        opt, losses = torch.optim.SGD(model.parameters(), lr=0.5), []
        for _ in range(3):
            opt.zero_grad()
            with step_cache.scope() if cached else contextlib.nullcontext():
                for batch in tokens.chunk(MICRO):
                    loss = model(batch, labels=torch.roll(batch, -1, 1)).mean() / MICRO
                    loss.backward()
                    losses.append(loss.detach())
            opt.step()
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        runs[side] = torch.stack(losses), weights, [s.amax_history.clone() for s in scalings], [len(c) for c in casts]
    assert runs["recompute"][3] == [3] * len(runs["recompute"][3]) and runs["uncached"][3] == [3 * MICRO] * len(runs["uncached"][3])
    references = ["plain", "uncached"] if recipe == "tensorwise" else ["plain"]
    for reference in references:
        (losses, weights, histories, _), (ref_losses, ref_weights, ref_histories, _) = runs["recompute"], runs[reference]
        assert torch.equal(losses, ref_losses)
        assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())
        assert _equal(histories, ref_histories)


def test_estimate_counts_the_copies_of_a_step_of_several_micro_batches():
    """2 bytes per block linear weight element on the first stage (both FP8 layouts) with FP8 and
    more than one micro batch a step; nothing with one micro batch, without FP8, on torchao's backend
    or under --compile; with FP8 experts their weights too."""
    b3 = ["--preset", "llama3-8b", "--num-layers", "8", "--seq-length", "8192", "--micro-batch-size", "1", "--bf16"]
    cfg = build_config(overrides=[*b3, "--global-batch-size", "8", "--fp8-format", "hybrid"])
    linears = sum(b.dense_matrix for b in rank_parameters(cfg.model, 128256, 8192).blocks)
    assert fp8_weight_copy_bytes(cfg) == 2 * linears and round(2 * linears / 2**30, 2) == 3.25  # 8 x 218 M weights
    est = estimate(cfg)
    one_micro = estimate(build_config(overrides=[*b3, "--global-batch-size", "1", "--fp8-format", "hybrid"]))
    assert est.fp8_weight_bytes == 2 * linears and one_micro.fp8_weight_bytes == 0  # one micro batch a step
    assert est.total_bytes - one_micro.total_bytes == 2 * linears and "FP8 weight copies" in est.table()
    fp8_on = ["--global-batch-size", "8", "--fp8-format", "hybrid"]
    for flags in (["--global-batch-size", "8"], [*fp8_on, "--fp8-backend", "torchao", "--fp8-recipe", "tensorwise"], [*fp8_on, "--compile"]):
        assert fp8_weight_copy_bytes(build_config(overrides=[*b3, *flags])) == 0, flags
    # Per data-parallel rank: 8 sequences over dp 8 is one micro batch each.
    assert fp8_weight_copy_bytes(cfg, world_size=8) == 0 and fp8_weight_copy_bytes(cfg, world_size=4) == 2 * linears
    # pp 2: the first stage's blocks only; tp 2: this rank's shards.
    pp = build_config(overrides=[*b3, "--global-batch-size", "8", "--fp8-format", "hybrid", "--pp", "2"])
    stage = sum(rank_parameters(pp.model, 128256, 8192).blocks[i].dense_matrix for i in first_stage_blocks(pp, 8, 2))
    assert 0 < fp8_weight_copy_bytes(pp, world_size=2) == 2 * stage < 2 * linears
    tp = build_config(overrides=[*b3, "--global-batch-size", "8", "--fp8-format", "hybrid", "--tp", "2"])
    assert fp8_weight_copy_bytes(tp, world_size=2) == linears
    moe = ["--preset", "tiny-mixtral", "--global-batch-size", "4", "--micro-batch-size", "1", "--bf16", "--fp8-format", "hybrid"]
    experts = sum(b.expert_matrix for b in rank_parameters(build_config(overrides=moe).model, 32000, 256).blocks)
    with_experts = fp8_weight_copy_bytes(build_config(overrides=[*moe, "--model.moe_fp8", "rowwise"]))
    assert experts and with_experts - fp8_weight_copy_bytes(build_config(overrides=[*moe, "--model.moe_fp8", "off"])) == 2 * experts


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_a_training_step_through_the_runner_casts_each_weight_once(monkeypatch, micro_batches):
    """Through ``build_runner`` (the FP8 device check bypassed: the CPU's ``_scaled_mm`` stands in),
    a step of several micro batches casts each block linear's weight once (the runner opens the
    scope), a step of one micro batch once as well; two steps, two casts each."""
    from meshtron.parallel import setup
    from meshtron.parallel.mesh import Mesh

    monkeypatch.setattr(setup, "check_fp8_device", lambda device: None)
    cfg = build_config(overrides=["--model.preset", "tiny-llama", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
                                  "--vocab-size", "128", "--seq-length", "32", "--micro-batch-size", "2",
                                  "--global-batch-size", str(2 * micro_batches), "--fp8-format", "hybrid", "--fp8-backend", "meshtron"])  # fmt: skip
    runner = setup.build_runner(cfg, Mesh.from_config(cfg.parallel, world_size=1, rank=0, local_rank=0), 128, torch.device("cpu"), torch.float32)
    linears = [m for m in runner.model.modules() if isinstance(m, fp8.Fp8Linear)]
    casts = {id(m.fp8): _count_weight_casts(m.fp8) for m in linears}
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        batches = [{"tokens": torch.randint(0, 128, (2, 32), generator=g), "labels": torch.randint(0, 128, (2, 32), generator=g),
                    "loss_mask": torch.ones(2, 32)} for _ in range(micro_batches)]  # fmt: skip
        runner.optimizer.zero_grad()
        runner.forward_backward(batches)
    assert len(linears) == 2 * 4  # per block: qkv, projection, fc1, fc2
    assert all(len(c) == 2 for c in casts.values()), {k: len(c) for k, c in casts.items()}
