"""The fused optimizer step (one Triton kernel per flat stretch) against the reference step
(clip multiply + torch.optim.AdamW + copy), on the CPU through Triton's interpreter.

Several steps with clipping active, a decay and a no-decay group, micro-batch accumulation, an
fp16 loss scale; replicated and distributed-optimizer layouts (one process). Masters and moments
agree to fp32 rounding (the kernel does the same operations in the same order), the model is
the masters' rounding. bf16 is left to the GPU test: Triton's interpreter casts fp32 to bf16 by
truncation, not rounding, so its model copy differs by design; fp16 covers the low-precision
write here. Skipped where Triton is missing or a GPU is present (tests/gpu/test_fused_adamw_gpu.py
runs it compiled).
"""

import copy
import os

import pytest
import torch
from torch import nn

from meshtron.config import TrainConfig
from meshtron.kernels import triton_available

pytestmark = pytest.mark.skipif(
    not triton_available() or torch.cuda.is_available(), reason="needs Triton, and no GPU (then tests/gpu covers it)"
)
if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from meshtron.optim.build import build_optimizer  # noqa: E402
from meshtron.kernels.checks import adamw_block_groups_check, fused_adamw_check, narrow_moments_check  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("distributed", [False, True])
def test_fused_step_matches_reference(dtype, distributed):
    worst = fused_adamw_check("cpu", dtype, distributed, steps=4)
    assert worst["master"] < 1e-6 and worst["exp_avg"] < 1e-6 and worst["exp_avg_sq"] < 1e-6, worst
    assert worst["model"] < 1e-6 and worst["grad_norm"] < 1e-6, worst


def test_block_group_summary_equals_reading_every_element():
    """Blocks of one group read one byte; blocks straddling a boundary read each element's group."""
    assert adamw_block_groups_check("cpu")


def test_fused_step_without_clipping_unscales_fp16():
    worst = fused_adamw_check("cpu", torch.float16, distributed=False, steps=3, clip=0.0)
    assert max(worst.values()) < 1e-6, worst


def test_fused_state_dict_round_trip_gives_identical_next_steps():
    """A loaded fused optimizer re-reads its step count (bias correction) from the loaded state."""
    c = TrainConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, optimizer_impl="fused")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)).to(torch.float16)
    other = copy.deepcopy(model)
    opt = build_optimizer(model, c, torch.float16)

    def steps(m, o, n):
        for i in range(n):
            o.zero_grad()
            m(torch.randn(5, 8, generator=torch.Generator().manual_seed(i)).to(torch.float16)).float().square().sum().backward()
            o.step(1e-2)

    steps(model, opt, 2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    steps(model, opt, 2)
    other_opt = build_optimizer(other, c, torch.float16)
    other.load_state_dict(saved_model)
    other_opt.load_state_dict(saved_opt)
    steps(other, other_opt, 2)
    assert other_opt.fused and int(other_opt.state_dict()["state"]["0.weight"]["step"]) == 4
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("distributed", [False, True])
def test_narrow_moments_equal_fp32_moments_rounded_after_each_step(distributed):
    """Precision-aware moments (``kernels/checks.narrow_moments_check``), fp16 here: Triton's
    interpreter rounds fp32 to fp16 correctly (to bf16 it truncates; the GPU test covers bf16)."""
    assert narrow_moments_check("cpu", "fp16", distributed)


def test_narrow_moments_state_dict_round_trip():
    """Saved and loaded in their narrow dtype, the next steps are identical."""
    c = TrainConfig(lr=1e-2, weight_decay=0.1, optimizer_impl="fused", use_precision_aware_optimizer=True,
                    exp_avg_dtype="fp16", exp_avg_sq_dtype="fp16")  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(torch.float16)
    other = copy.deepcopy(model)
    opt, other_opt = build_optimizer(model, c, torch.float16), build_optimizer(other, c, torch.float16)

    def step(m, o, i):
        o.zero_grad()
        m(torch.randn(5, 8, generator=torch.Generator().manual_seed(i)).to(torch.float16)).float().square().sum().backward()
        o.step(1e-2)

    for i in range(2):
        step(model, opt, i)
    saved = opt.state_dict()
    assert saved["state"]["0.weight"]["exp_avg"].dtype == torch.float16
    other_opt.load_state_dict(saved)
    with torch.no_grad():
        for p, q in zip(other.parameters(), model.parameters()):
            p.copy_(q)
    for i in range(2, 4):
        step(model, opt, i)
        step(other, other_opt, i)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
