"""Muon on one process (``--optimizer muon``) against a plain float64 implementation of its update.

The reference below is written from the algorithm, not from ``meshtron/optim/muon.py``: momentum as
an average, decoupled weight decay, Newton-Schulz with the quintic coefficients in float64, the
spectral scale, and the blocks cut by hand from the model's shape (q / k / v rows of each query
group of the fused QKV weight, SwiGLU's gate and up halves, each routed expert alone). Muon's own
iterations run in fp32 here (``--muon-fp32-matmul-prec high``): the updates agree to 1e-4 relative
(fp32 against float64 over five iterations). Which parameters Muon takes, the optimizer choice's
flags and their errors are checked too.
"""

from __future__ import annotations

import pytest
import torch

from meshtron.config import build_config
from meshtron.errors import CheckpointError, ConfigError
from meshtron.optim.muon import newton_schulz
from meshtron.optim.muon_batch import orthogonalize_blocks
from meshtron.training.trainer import Trainer
from meshtron.validation import validate

HEADS, GROUPS, HIDDEN, FFN = 4, 2, 64, 48
HEAD_DIM = HIDDEN // HEADS
TINY = ["--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "1", "--num-layers", "2", "--hidden-size", str(HIDDEN),
        "--ffn-hidden-size", str(FFN), "--num-attention-heads", str(HEADS), "--num-query-groups", str(GROUPS), "--swiglu",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-2",
        "--fp32", "--eval-interval", "0", "--device", "cpu", "--clip-grad", "0", "--weight-decay", "0.1", "--optimizer", "muon",
        "--muon-fp32-matmul-prec", "high"]  # fmt: skip
MOE = ["--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"]
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def reference_ns(x: torch.Tensor) -> torch.Tensor:
    """Float64 quintic Newton-Schulz of one matrix."""
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm()
    for a, b, c in QUINTIC:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def blocks(name: str, rows: int) -> list[torch.Tensor]:
    """Row indices of each block of a weight, by hand from the model's shape."""
    if name.endswith("linear_qkv.weight"):
        per_group = (HEADS // GROUPS + 2) * HEAD_DIM
        q = HEADS // GROUPS * HEAD_DIM
        spans = {"q": (0, q), "k": (q, q + HEAD_DIM), "v": (q + HEAD_DIM, per_group)}
        return [torch.cat([torch.arange(g * per_group + a, g * per_group + b) for g in range(GROUPS)]) for a, b in spans.values()]
    if name.endswith("linear_fc1.weight") or name.endswith("experts.weight1"):
        return [torch.arange(rows // 2), torch.arange(rows // 2, rows)]
    return [torch.arange(rows)]


def reference_update(name: str, momentum: torch.Tensor) -> torch.Tensor:
    """The orthogonalized, spectrally scaled update of one weight (a stack of experts: each alone)."""
    if momentum.dim() == 3:
        return torch.stack([reference_update(name, m) for m in momentum])
    out = torch.zeros_like(momentum, dtype=torch.float64)
    for rows in blocks(name, momentum.shape[0]):
        block = momentum[rows]
        out[rows] = reference_ns(block) * max(block.shape) ** 0.5
    return out


def trainer(extra: list[str]) -> Trainer:
    return Trainer(build_config(None, TINY + extra), log=lambda _: None)


def fake_step(opt, model, seed: int) -> dict[str, torch.Tensor]:
    """Give every parameter the gradient ``R`` (a backward of ``sum(p * R)``) and return the ``R``s."""
    gen = torch.Generator().manual_seed(seed)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    opt.zero_grad()
    sum((p * grads[n]).sum() for n, p in model.named_parameters()).backward()
    return grads


@pytest.mark.parametrize("extra", [[], MOE], ids=["dense", "moe"])
def test_muon_matches_a_float64_reference_and_adamw_takes_the_rest(extra):
    t = trainer(extra)
    model, opt = t.model, t.optimizer
    rule = {n: g["optimizer"] for g in opt.param_groups for n in g["param_names"]}
    muon = sorted(n for n, r in rule.items() if r == "muon")
    expected = sorted(n for n, p in model.named_parameters()
                      if n.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight", "weight1", "weight2")))  # fmt: skip
    assert muon == expected and muon
    adam = {n for n, r in rule.items() if r == "adam"}
    assert {"embedding.weight", "output.weight", "final_norm.weight"} <= adam
    assert all(rule[n] == "adam" for n, p in model.named_parameters() if p.dim() == 1)  # biases and norms
    assert extra or "layers.0.self_attention.linear_qkv.bias" in adam
    assert not extra or any(n.endswith("router.weight") for n in adam)

    lr, wd, beta = 1e-2, 0.1, 0.9
    start = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    momentum = {n: torch.zeros_like(w) for n, w in start.items()}
    expect = dict(start)
    for step in range(2):
        grads = fake_step(opt, model, seed=step)
        opt.step(lr)
        for n in muon:
            momentum[n] = momentum[n] + (1 - beta) * (grads[n].double() - momentum[n])
            expect[n] = expect[n] * (1 - lr * wd) - lr * reference_update(n, momentum[n])
    for n in muon:
        got = dict(model.named_parameters())[n].detach().double()
        moved, want = got - start[n], expect[n] - start[n]
        assert torch.allclose(moved, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), (n, (moved - want).abs().max())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("extra", [[], MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("prec", ["high", "medium"])
def test_batched_orthogonalization_equals_one_block_at_a_time(device, extra, prec):
    """A step stacks the blocks of equal shape of all its matrices (``muon_batch.py``) and runs
    Newton-Schulz once per shape; each block's result is Newton-Schulz of that block alone, scaled
    (blocks cut by hand as in the float64 test, each expert alone): to 1e-5 in fp32, to 3e-2
    (a few bf16 roundings of values ~1) with the iterations in bf16 (``medium``). On the CPU
    both are bit-equal here (the batched and the single GEMMs round alike); a GPU may pick
    other GEMM kernels for a batch."""
    muon = trainer(extra + ["--muon-fp32-matmul-prec", prec]).optimizer.rules["muon"]
    names = [n for g in muon.param_groups for n in g["param_names"]]
    masters = [m for g in muon.param_groups for m in g["params"]]
    gen = torch.Generator().manual_seed(0)
    updates = [torch.randn(m.shape, generator=gen).to(device) for m in masters]
    for m in masters:
        muon.plans[id(m)].on(torch.device(device))
    shapes = []

    def counted(stacked):
        shapes.append(tuple(stacked.shape))
        return muon._orthogonalize(stacked)

    outs = orthogonalize_blocks(updates, [muon.plans[id(m)].blocks for m in masters], counted)
    compared = 0
    for name, update, out in zip(names, updates, outs, strict=True):
        for matrix, result in zip(update.reshape(-1, *update.shape[-2:]), out.reshape(-1, *out.shape[-2:])):  # each expert alone
            for rows in blocks(name, matrix.shape[0]):
                alone = newton_schulz(matrix[rows.to(device)], 5, "quintic", in_bf16=prec == "medium") * max(len(rows), matrix.shape[1]) ** 0.5
                tolerance = 1e-5 if prec == "high" else 3e-2
                torch.testing.assert_close(result[rows], alone, rtol=tolerance, atol=tolerance, msg=lambda m, name=name: f"{name}: {m}")
                compared += 1
    block_shapes = {(s[1], s[2]) for s in shapes}
    assert len(shapes) == len(block_shapes) < compared  # one batch per block shape, several blocks in some
    assert sum(s[0] for s in shapes) == compared


def test_newton_schulz_in_bf16_stays_near_fp32_and_orthogonalizes():
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(0))
    fp32, bf16 = newton_schulz(x, 5, "quintic", in_bf16=False), newton_schulz(x, 5, "quintic", in_bf16=True)
    singular = torch.linalg.svdvals(fp32)
    assert singular.min() > 0.6 and singular.max() < 1.25  # the tuned quintic's band around 1
    assert (bf16 - fp32).abs().max() < 0.05
    assert torch.allclose(newton_schulz(x.T.contiguous(), 5, "quintic", in_bf16=False), fp32.T, atol=1e-5)


def test_sgd_is_torch_sgd_with_momentum():
    t = trainer(["--optimizer", "sgd", "--sgd-momentum", "0.5"])
    model, opt = t.model, t.optimizer
    assert {g["optimizer"] for g in opt.param_groups} == {"sgd"}
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = {n: p.clone().requires_grad_(True) for n, p in start.items()}
    decay = {n for g in opt.param_groups if g["weight_decay"] for n in g["param_names"]}
    sgd = torch.optim.SGD([{"params": [ref[n] for n in ref if n in decay], "weight_decay": 0.1},
                           {"params": [ref[n] for n in ref if n not in decay], "weight_decay": 0.0}], lr=1e-2, momentum=0.5)  # fmt: skip
    for step in range(2):
        grads = fake_step(opt, model, seed=step)
        opt.step(1e-2)
        for n, p in ref.items():
            p.grad = grads[n].clone()
        sgd.step()
    for n, p in model.named_parameters():
        assert torch.allclose(p.detach(), ref[n].detach(), rtol=1e-6, atol=1e-7), n
    assert all(s["step"].item() == 2 for s in opt.rules["sgd"].state.values())


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "lion"], "--optimizer lion: one of adam | sgd | muon"),
    (["--optimizer", "dist_muon"], "use --optimizer muon --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--overlap-param-gather"], "--overlap-param-gather overlaps the flat-range"),
    (["--optimizer", "sgd", "--sgd-momentum", "1.5"], "--sgd-momentum 1.5: must be in"),
    (["--optimizer-impl", "fused"], "fused is AdamW's kernel"),
    (["--muon-num-ns-steps", "3"], "--muon-num-ns-steps 3: must be a positive multiple of 5"),
    (["--muon-tp-mode", "distributed"], "--muon-tp-mode distributed"),
    (["--muon-scale-mode", "rms"], "--muon-scale-mode rms"),
    (["--muon-scalar-optimizer", "lion"], "--muon-scalar-optimizer lion"),
    (["--expert-tensor-parallel-size", "2", *MOE, "--tp", "2"], "--expert-tensor-parallel-size > 1"),
])  # fmt: skip
def test_bad_optimizer_flags_fail_early(flags, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|")):
        validate(build_config(None, TINY + flags), world_size=4)


def test_muon_flags_reach_the_settings():
    t = build_config(None, TINY + ["--muon-momentum", "0.95", "--muon-nesterov", "--muon-no-split-qkv", "--muon-scale-mode", "unit_rms_norm",
                                   "--muon-extra-scale-factor", "0.2", "--muon-tp-mode", "blockwise", "--sgd-momentum", "0.8"]).train  # fmt: skip
    assert (t.muon_momentum, t.muon_nesterov, t.muon_split_qkv, t.muon_scale_mode, t.muon_extra_scale_factor, t.muon_tp_mode, t.sgd_momentum) == (
        0.95, True, False, "unit_rms_norm", 0.2, "blockwise", 0.8)


@pytest.mark.parametrize("optimizer", ["adam", "muon", "sgd"])
def test_estimate_counts_each_rules_state_as_the_built_optimizer_holds_it(optimizer):
    """``meshtron estimate``'s optimizer bytes (bf16: fp32 masters, then AdamW's two moments per
    non-matrix, Muon's one momentum per matrix, SGD's one momentum) equal what the optimizer allocates."""
    from meshtron.estimate import estimate

    flags = TINY + MOE + ["--bf16", "--optimizer", optimizer]
    cfg = build_config(None, flags)
    built = Trainer(cfg, log=lambda _: None).optimizer.memory_bytes()
    assert estimate(cfg).optimizer_bytes == built
    if optimizer == "muon":  # less than AdamW's: a matrix keeps 8 bytes, not 12
        assert built < estimate(build_config(None, flags + ["--optimizer", "adam"])).optimizer_bytes


def test_a_checkpoint_of_another_optimizer_is_refused_with_the_fix(tmp_path):
    Trainer(build_config(None, TINY + ["--optimizer", "adam", "--save", str(tmp_path), "--train-iters", "1"]), log=lambda _: None).run()
    with pytest.raises(CheckpointError, match="another --optimizer than the checkpoint's"):
        Trainer(build_config(None, TINY + ["--load", str(tmp_path)]), log=lambda _: None).run()
    resumed = Trainer(build_config(None, TINY + ["--load", str(tmp_path), "--no-load-optim", "--no-load-rng"]), log=lambda _: None).run()
    assert resumed.iteration == 2
