"""MixedPrecisionOptimizer: exact AdamW in fp32, fp32 masters and accumulation in bf16, fp16 overflow skips."""

import copy

import pytest
import torch
from torch import nn

from meshtron.config import TrainConfig
from meshtron.optim.lr_schedule import LRSchedule
from meshtron.optim.build import build_optimizer
from meshtron.optim.optimizer import build_param_groups

VOCAB, HIDDEN = 16, 8


class Tiny(nn.Module):
    """Embedding, matrices, biases and a norm: every kind of param the grouping rule sees."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        return self.out(self.norm(torch.relu(self.fc(self.emb(tokens)))))


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return Tiny().to(dtype)


def batch(step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_of(model, step, micro=0):
    tokens, labels = batch(step, micro)
    return nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), labels.flatten())


def cfg(**kw):
    base = dict(lr=1e-2, min_lr=1e-3, lr_warmup_iters=2, train_iters=10, weight_decay=0.1, clip_grad=0.5)
    return TrainConfig(**{**base, **kw})


def train(model, opt, steps, start=0, micro_batches=1):
    sched = LRSchedule.from_config(cfg())
    results = []
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            opt.scale_loss(loss_of(model, step, micro) / micro_batches).backward()
        results.append(opt.step(sched.lr_at(step)))
    return results


def test_fp32_matches_clip_grad_norm_plus_adamw_bit_for_bit():
    model, ref_model = make_model(), make_model()
    c = cfg()
    opt = build_optimizer(model, c, torch.float32)
    ref = torch.optim.AdamW(build_param_groups(ref_model, c.weight_decay), lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)
    sched = LRSchedule.from_config(c)
    clipped = 0
    for step in range(5):
        opt.zero_grad()
        loss_of(model, step).backward()
        result = opt.step(sched.lr_at(step))

        ref.zero_grad()
        loss_of(ref_model, step).backward()
        # norms are summed in param-group order, as the optimizer walks its params
        ref_norm = torch.nn.utils.clip_grad_norm_([p for g in ref.param_groups for p in g["params"]], c.clip_grad)
        for group in ref.param_groups:
            group["lr"] = sched.lr_at(step)
        ref.step()

        assert result.grad_norm == ref_norm.item() and not result.skipped and result.loss_scale == 1.0
        clipped += ref_norm.item() > c.clip_grad
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, q)
    assert clipped > 0  # the comparison covered clipping


def test_bf16_keeps_fp32_masters_and_model_is_their_rounding():
    model = make_model(dtype=torch.bfloat16)
    opt = build_optimizer(model, cfg(), torch.bfloat16)
    opt.zero_grad()
    loss_of(model, 0).backward()
    assert all(p.grad is None for p in model.parameters())  # moved into the masters, freed
    masters = opt.state_dict()["master"]
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in masters.values())
    opt.step(1e-2)
    train(model, opt, 3, start=1)
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and masters[name].dtype == torch.float32
        assert torch.equal(param, masters[name].to(torch.bfloat16))
    # masters carry precision the model cannot: they are not all representable in bf16
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())


def test_bf16_accumulates_micro_batches_in_fp32_exactly():
    w = nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16))
    holder = nn.Module()
    holder.w = w
    opt = build_optimizer(holder, cfg(), torch.bfloat16)
    tiny = 2.0**-9  # 1 + 2^-9 rounds back to 1 in bf16 (8-bit mantissa)
    assert torch.tensor(1.0, dtype=torch.bfloat16) + tiny == 1.0
    opt.zero_grad()
    for x in (1.0, tiny, tiny, tiny):
        (w * x).sum().backward()
    grad = opt.state_dict()["master"]["w"].grad
    assert torch.equal(grad, torch.full((2, 2), 1.0 + 3 * tiny))


def test_bf16_accumulated_grads_match_fp32_reference():
    model, ref = make_model(dtype=torch.bfloat16), make_model()
    opt = build_optimizer(model, cfg(), torch.bfloat16)
    opt.zero_grad()
    for micro in range(4):
        (loss_of(model, 0, micro) / 4).backward()
        (loss_of(ref, 0, micro) / 4).backward()
    masters = opt.state_dict()["master"]
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name].grad, p.grad, rtol=5e-2, atol=5e-3)


def fp16_model():
    holder = nn.Module()
    holder.w = nn.Parameter(torch.ones(4, 4, dtype=torch.float16))
    holder.b = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    return holder


@pytest.mark.parametrize("clip", [0.5, 0.0])
def test_fp16_overflow_skips_step_and_backs_off_after_hysteresis(clip):
    model = fp16_model()
    c = cfg(initial_loss_scale=1024.0, hysteresis=2, loss_scale_window=1000, clip_grad=clip)
    opt = build_optimizer(model, c, torch.float16)
    x = torch.full((4, 4), 0.5, dtype=torch.float16)

    def step(bad):
        opt.zero_grad()
        inputs = x.clone()
        if bad:
            inputs[0, 0] = float("inf")
        opt.scale_loss(((model.w * inputs).sum() + model.b.sum()).float()).backward()
        return opt.step(1e-2)

    before = copy.deepcopy(model.state_dict())
    first = step(bad=True)
    assert first.skipped and not torch.isfinite(torch.tensor(first.grad_norm)) and first.loss_scale == 1024.0
    second = step(bad=True)
    assert second.skipped and second.loss_scale == 512.0  # hysteresis 2: the second overflow halves
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # skipped steps changed nothing
    assert opt.state_dict()["state"]["w"]["step"].item() == 0

    good = step(bad=False)
    assert not good.skipped and good.loss_scale == 512.0
    # reported norm is the true (unscaled) one: ||0.5 * ones(4,4)|| and ||ones(4)||
    assert good.grad_norm == pytest.approx((16 * 0.25 + 4) ** 0.5, rel=1e-6)
    assert not torch.equal(model.w, before["w"])
    # the update used unscaled gradients, clipped to clip_grad when set
    master_grads = [m.grad for m in opt.state_dict()["master"].values()]
    expected = min(clip, good.grad_norm) if clip else good.grad_norm
    assert torch.nn.utils.get_total_norm(master_grads).item() == pytest.approx(expected, rel=1e-5)


def test_clipping_scales_grads_to_clip_norm():
    model = make_model()
    opt = build_optimizer(model, cfg(clip_grad=0.05), torch.float32)
    opt.zero_grad()
    loss_of(model, 0).backward()
    result = opt.step(1e-3)
    assert result.grad_norm > 0.05
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert clipped.item() == pytest.approx(0.05, rel=1e-4)


def test_no_weight_decay_on_1d_params():
    model = make_model()
    groups = build_param_groups(model, 0.5)
    names = {g["weight_decay"]: [n for n, _ in g["params"]] for g in groups}
    assert names[0.5] == ["emb.weight", "fc.weight", "out.weight"]
    assert names[0.0] == ["fc.bias", "norm.weight", "norm.bias", "out.bias"]

    opt = build_optimizer(model, cfg(weight_decay=0.5, clip_grad=0.0), torch.float32)
    assert [g["param_names"] for g in opt.param_groups] == [names[0.5], names[0.0]]
    before = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    (0.0 * loss_of(model, 0)).backward()  # zero grads: only decay moves the weights
    opt.step(1.0)
    for name, p in model.named_parameters():
        factor = 0.5 if p.ndim >= 2 else 1.0
        torch.testing.assert_close(p, before[name] * factor, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_dict_round_trip_gives_identical_next_steps(dtype):
    c = cfg(initial_loss_scale=256.0, loss_scale_window=2)
    model = make_model(dtype=dtype)
    opt = build_optimizer(model, c, dtype)
    train(model, opt, 3, micro_batches=2)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    assert set(saved_opt["state"]) == {n for n, _ in model.named_parameters()}  # keyed by name
    first = train(model, opt, 3, start=3, micro_batches=2)

    other = make_model(seed=1, dtype=dtype)
    other_opt = build_optimizer(other, c, dtype)
    other.load_state_dict(saved_model)
    other_opt.load_state_dict(saved_opt)
    second = train(other, other_opt, 3, start=3, micro_batches=2)
    assert first == second
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_load_state_dict_rejects_another_model():
    opt = build_optimizer(make_model(), cfg(), torch.float32)
    sd = opt.state_dict()
    sd["master"] = {"x" + k: v for k, v in sd["master"].items()}
    with pytest.raises(ValueError, match="missing"):
        opt.load_state_dict(sd)


def test_build_optimizer_checks_the_model_was_cast():
    with pytest.raises(ValueError, match="cast the model"):
        build_optimizer(make_model(), cfg(), torch.bfloat16)


def test_precision_aware_moment_flags_are_checked_and_estimated():
    """Megatron's --use-precision-aware-optimizer / --exp-avg-dtype / --exp-avg-sq-dtype: narrow
    moments need the flag and the fused step (a GPU), the reference step refuses them, bf16 main
    grads and fp16 main params are refused, and the estimate counts 2-byte moments."""
    from meshtron.config import ConfigError, build_config
    from meshtron.estimate import estimate
    from meshtron.validation import validate

    def errors(*flags: str) -> str:
        try:
            validate(build_config(overrides=["--preset", "tiny-llama", "--mock-data", *flags]))
        except ConfigError as e:
            return str(e)
        return ""

    assert "takes effect with --use-precision-aware-optimizer" in errors("--exp-avg-dtype", "bf16")
    assert "needs the fused optimizer step" in errors("--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "bf16", "--device", "cpu")
    assert "must be one of fp32, bf16, fp16" in errors("--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8")
    assert "--main-grads-dtype bf16" in errors("--main-grads-dtype", "bf16")
    assert "--main-params-dtype fp16" in errors("--main-params-dtype", "fp16")
    assert errors("--main-grads-dtype", "fp32", "--device", "cpu") == ""
    gpu = ["--preset", "tiny-llama", "--bf16", "--device", "cuda"]
    wide, narrow = (estimate(build_config(overrides=[*gpu, *f])) for f in ([], ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]))
    assert wide.optimizer_bytes - narrow.optimizer_bytes == 4 * wide.params
    with pytest.raises(ValueError, match="need the fused optimizer step"):
        model = nn.Linear(4, 4).to(torch.bfloat16)
        build_optimizer(model, TrainConfig(optimizer_impl="reference", exp_avg_dtype="bf16", use_precision_aware_optimizer=True), torch.bfloat16)
