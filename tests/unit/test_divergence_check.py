"""Divergence: a non-finite loss or grad norm stops bf16/fp32 runs at once, fp16 runs after N
skipped steps in a row, and the error names the iteration, the rank and the first bad module."""

import math

import pytest
import torch
from torch import nn

from meshtron.config import TrainConfig
from meshtron.optim.optimizer import StepResult
from meshtron.training.divergence import DivergenceError, DivergenceMonitor, first_nonfinite_module

OK = StepResult(grad_norm=1.0, skipped=False, loss_scale=1.0)
OVERFLOW = StepResult(grad_norm=math.inf, skipped=True, loss_scale=1.0)


def monitor(precision="bf16", rank=0, model=None, **fields):
    return DivergenceMonitor.from_config(TrainConfig(**fields), precision, rank, model or nn.Linear(2, 2))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("loss, step", [(math.nan, OK), (2.0, OVERFLOW), (math.inf, OK)])
def test_any_nonfinite_value_stops_bf16_and_fp32(precision, loss, step):
    m = monitor(precision, rank=3)
    m.check(1, 2.0, OK)
    with pytest.raises(DivergenceError, match="diverged at iteration 2 on rank 3: non-finite (loss|grad norm)"):
        m.check(2, loss, step)


def test_fp16_skips_are_normal_until_too_many_in_a_row():
    m = monitor("fp16", max_consecutive_skipped_steps=3)
    for iteration in range(1, 7):  # two skipped, one clean: never three in a row
        m.check(iteration, 2.0, OK if iteration % 3 == 0 else OVERFLOW)
    m.check(7, math.nan, OVERFLOW)
    m.check(8, 2.0, OVERFLOW)
    with pytest.raises(DivergenceError, match="iteration 9 on rank 0: 3 consecutive steps skipped"):
        m.check(9, 2.0, OVERFLOW)


def test_switched_off():
    m = monitor("bf16", check_for_nan_in_loss_and_grad=False, max_consecutive_skipped_steps=0)
    for iteration in range(50):
        m.check(iteration, math.nan, OVERFLOW)
    backstop = monitor("bf16", check_for_nan_in_loss_and_grad=False, max_consecutive_skipped_steps=2)
    backstop.check(1, math.nan, OVERFLOW)
    with pytest.raises(DivergenceError, match="2 consecutive steps skipped"):
        backstop.check(2, math.nan, OVERFLOW)


def poisoned_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 4)), nn.Linear(4, 1))
    with torch.no_grad():
        model[1][1].weight[0, 0] = math.inf
    return model


def test_first_nonfinite_module_is_the_innermost_producer():
    model = poisoned_model()
    x = torch.ones(2, 4)
    assert first_nonfinite_module(model, lambda: model(x)) == "1.1"
    assert first_nonfinite_module(nn.Linear(4, 1), lambda: None) is None
    assert not model[0]._forward_hooks  # hooks removed


def test_error_names_the_module_or_says_where_to_look():
    model = poisoned_model()
    with pytest.raises(DivergenceError, match=r"first module with a non-finite output: 1\.1\. Nothing was saved"):
        monitor(model=model).check(4, math.nan, OVERFLOW, rerun=lambda: model(torch.ones(2, 4)))
    with pytest.raises(DivergenceError, match="none in the forward pass"):
        monitor().check(4, 2.0, OVERFLOW, rerun=lambda: None)
    with pytest.raises(DivergenceError, match="not located"):
        monitor().check(4, 2.0, OVERFLOW)
