"""LR schedule values at the points that define each style (step i uses n = i + 1)."""

import math

import pytest

from meshtron.config import TrainConfig
from meshtron.optim.lr_schedule import LRSchedule

MAX, MIN = 1.0, 0.1


def sched(style, warmup=10, decay=110, wsd=0):
    return LRSchedule(MAX, MIN, warmup, decay, style, wsd_decay_iters=wsd)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "wsd"])
def test_warmup_is_linear_from_the_first_step(style):
    s = sched(style)
    assert s.lr_at(0) == pytest.approx(0.1)  # never 0: the first step already learns
    assert s.lr_at(4) == pytest.approx(0.5)
    assert s.lr_at(9) == pytest.approx(1.0)  # the last warmup step reaches max_lr


def test_cosine():
    s = sched("cosine")
    assert s.lr_at(10) == pytest.approx(MIN + 0.5 * (1 + math.cos(math.pi * 0.01)) * 0.9)
    assert s.lr_at(59) == pytest.approx(0.55)  # half way: ratio 0.5
    assert s.lr_at(109) == pytest.approx(MIN)  # step decay_iters - 1 ends at min_lr
    assert s.lr_at(500) == MIN


def test_linear():
    s = sched("linear")
    assert s.lr_at(34) == pytest.approx(MIN + 0.75 * 0.9)
    assert s.lr_at(59) == pytest.approx(0.55)
    assert s.lr_at(109) == pytest.approx(MIN)
    assert s.lr_at(110) == MIN


def test_constant_stays_at_max_like_megatron():
    s = sched("constant")
    assert s.lr_at(10) == MAX
    assert s.lr_at(1000) == MAX


def test_wsd_default_anneal_is_last_tenth():
    s = sched("wsd")  # anneal over the last 11 of 110 steps: n in (99, 110]
    assert s.lr_at(50) == MAX
    assert s.lr_at(98) == MAX  # n = 99: last stable step
    assert s.lr_at(104) == pytest.approx(MIN + (1 - 6 / 11) * 0.9)
    assert s.lr_at(109) == pytest.approx(MIN)
    assert s.lr_at(200) == MIN


def test_wsd_explicit_anneal_length():
    s = sched("wsd", wsd=20)
    assert s.lr_at(89) == MAX
    assert s.lr_at(99) == pytest.approx(MIN + 0.5 * 0.9)


def test_no_warmup_starts_decaying_at_once():
    s = LRSchedule(MAX, MIN, 0, 100, "linear")
    assert s.lr_at(0) == pytest.approx(MAX - 0.01 * 0.9)


def test_warmup_longer_than_run_keeps_rising_then_min():
    s = LRSchedule(MAX, MIN, 30, 20, "cosine")
    assert s.lr_at(19) == pytest.approx(20 / 30)
    assert s.lr_at(30) == MIN


def test_from_config_decays_over_the_run_when_unset():
    cfg = TrainConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=5, lr_decay_iters=0, train_iters=50, lr_decay_style="linear")
    s = LRSchedule.from_config(cfg)
    assert s.state_dict() == {
        "max_lr": 3e-3, "min_lr": 3e-4, "warmup_iters": 5, "decay_iters": 50, "style": "linear", "wsd_decay_iters": 0, "unit": "iterations",
    }
    assert s.lr_at(49) == pytest.approx(3e-4)


def test_rejects_bad_parameters():
    with pytest.raises(ValueError, match="style"):
        LRSchedule(1, 0, 0, 10, "exp")
    with pytest.raises(ValueError, match="min_lr"):
        LRSchedule(1, 2, 0, 10, "cosine")


@pytest.mark.parametrize("flags, warmup, decay, unit", [
    # GPT-3 175B's example: a thousandth of 430,000 decay iterations
    ("--train-iters 500000 --lr-decay-iters 430000 --lr-warmup-fraction .001", 430, 430000, "iterations"),
    ("--global-batch-size 8 --train-samples 8000 --lr-warmup-fraction 0.0125", 100, 8000, "samples"),
])  # fmt: skip
def test_lr_warmup_fraction_warms_up_over_that_share_of_the_decay_span(flags, warmup, decay, unit):
    from meshtron.config import build_config

    state = LRSchedule.from_config(build_config(None, flags.split()).train).state_dict()
    assert (state["warmup_iters"], state["decay_iters"], state["unit"]) == (warmup, decay, unit)


@pytest.mark.parametrize("flags, message", [
    ("--lr-warmup-fraction 0.1 --lr-warmup-iters 5", "--lr-warmup-fraction and --lr-warmup-iters both set the warm-up"),
    ("--train-samples 800 --lr-warmup-fraction 0.1 --lr-warmup-samples 5", "and --lr-warmup-samples both set the warm-up"),
    ("--lr-warmup-fraction 1.5", r"--lr-warmup-fraction must be in \(0, 1\]"),
])  # fmt: skip
def test_lr_warmup_fraction_beside_a_count_is_refused(flags, message):
    from meshtron.config import build_config
    from meshtron.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        build_config(None, flags.split())
