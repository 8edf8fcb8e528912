"""Sample-based training and the batch ramp (Megatron's --train-samples, --rampup-batch-size,
--lr-*-samples): the flags, the ramp's batches and micro batches, the iterations, the schedule's
rates against Megatron's formulas worked by hand, and the refusals."""

import math

import pytest

from meshtron.config import ConfigError, build_config
from meshtron.optim.lr_schedule import LRSchedule
from meshtron.training.batch_schedule import BatchSchedule, iterations_for_samples
from meshtron.validation import validate

RAMP = ["--global-batch-size", "16", "--micro-batch-size", "2", "--rampup-batch-size", "4", "4", "300", "--mock-data"]


def test_flags_set_the_fields_and_train_iters_becomes_megatrons_count():
    cfg = build_config(None, [*RAMP, "--train-samples", "1000", "--lr-warmup-samples", "100", "--lr-decay-samples", "900",
                              "--lr-decay-style", "wsd", "--lr-wsd-decay-samples", "50"])  # fmt: skip
    t = cfg.train
    assert t.rampup_batch_size == [4, 4, 300] and t.train_samples == 1000
    assert (t.lr_warmup_samples, t.lr_decay_samples, t.lr_wsd_decay_samples) == (100, 900, 50)
    # By hand, Megatron's update_train_iters: 100 samples per increment. Batch 4 for 25 steps (to
    # 100 consumed), 8 for 13 steps (to 204: 196 is still below 200), 12 for 8 steps (to 300), then
    # 300 <= 300 so one more step of 16 (to 316) ends the ramp loop; (1000 - 316) // 16 = 42 more.
    assert t.train_iters == 25 + 13 + 8 + 1 + 42
    assert t.lr_warmup_iters == 0  # the iteration default (30) does not apply
    validate(cfg, world_size=1)


def test_without_a_ramp_the_iterations_are_whole_global_batches():
    assert build_config(None, ["--global-batch-size", "16", "--train-samples", "1000", "--mock-data"]).train.train_iters == 62


def test_the_ramp_follows_megatrons_rule_and_its_micro_batches_follow_the_batch():
    ramp = BatchSchedule(16, (4, 4, 300))
    assert ramp.sizes() == [4, 8, 12, 16]
    expected = {0: 4, 99: 4, 100: 8, 199: 8, 200: 12, 299: 12, 300: 16, 301: 16, 10**6: 16}
    assert {c: ramp.batch_at(c) for c in expected} == expected
    # Megatron's float: 100 samples over 3 increments of 2 -> 33.33.. samples each
    odd = BatchSchedule(10, (4, 2, 100))
    assert [odd.batch_at(c) for c in (33, 34, 66, 67, 99, 100, 101)] == [4, 6, 6, 8, 8, 10, 10]
    # micro batches of 2 samples on 2 data-parallel ranks: a step of batch b runs b / 4 of them
    assert [b // (2 * 2) for b in ramp.sizes()] == [1, 2, 3, 4]
    assert BatchSchedule(16).batch_at(0) == 16 and BatchSchedule(16).sizes() == [16]


def test_iterations_stop_at_train_samples_inside_the_ramp():
    # ramp loop stops once consumed > train_samples: 4 x 25 = 100, then 8 -> 108 > 101
    assert iterations_for_samples(101, BatchSchedule(16, (4, 4, 300))) == 26


def test_sample_schedule_against_megatrons_formulas_by_hand():
    t = build_config(None, [*RAMP, "--train-samples", "1000", "--lr", "1.0", "--min-lr", "0.1", "--lr-warmup-samples", "100",
                            "--lr-decay-samples", "900"]).train  # fmt: skip
    s = LRSchedule.from_config(t)
    assert s.unit == "samples" and (s.warmup_iters, s.decay_iters) == (100, 900)
    # step 0: batch 4, evaluated at the 4 samples consumed after it (warm-up: 4 / 100 of the peak)
    assert s.lr_for_step(0, 0, 4) == pytest.approx(0.04)
    assert s.lr_for_step(24, 96, 4) == pytest.approx(1.0)  # n = 100: warm-up's end
    # step at 204 consumed with batch 12: n = 216, cosine ratio (216 - 100) / (900 - 100)
    assert s.lr_for_step(38, 204, 12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 116 / 800)))
    assert s.lr_for_step(80, 888, 16) == pytest.approx(0.1)  # n = 904 > 900: min_lr
    # the iteration argument is not used in samples
    assert s.lr_for_step(0, 204, 12) == s.lr_for_step(38, 204, 12)


def test_a_constant_batch_in_samples_gives_the_iteration_schedules_rates():
    iters = LRSchedule(1.0, 0.1, 10, 110, "cosine")
    samples = LRSchedule(1.0, 0.1, 10 * 8, 110 * 8, "cosine", unit="samples")
    for i in range(120):
        assert samples.lr_for_step(i, 8 * i, 8) == pytest.approx(iters.lr_for_step(i, 8 * i, 8), abs=1e-12)
    assert build_config(None, ["--mock-data"]).train.train_samples == 0 and LRSchedule.from_config(build_config(None, []).train).unit == "iterations"


@pytest.mark.parametrize("flags, message", [
    (["--train-samples", "1000", "--train-iters", "10"], "drop --train-iters"),
    (["--train-samples", "1000", "--lr-decay-iters", "10"], "drop --lr-decay-iters"),
    (["--train-samples", "1000", "--lr-warmup-iters", "5"], "drop --lr-warmup-iters"),
    (["--train-samples", "1000", "--lr-wsd-decay-iters", "5"], "drop --lr-wsd-decay-iters"),
    (["--rampup-batch-size", "4", "4", "300"], "--rampup-batch-size count samples: add --train-samples"),
    (["--lr-decay-samples", "100", "--lr-warmup-samples", "5"], "--lr-decay-samples, --lr-warmup-samples count samples"),
    (["--train-samples", "0"], "--train-samples must be positive"),
    (["--train-samples", "10"], "less than one global batch"),
    (["--train-samples", "100", "--rampup-batch-size", "4", "4"], "takes 3 values"),
    (["--train-samples", "100", "--rampup-batch-size", "16", "4", "300"], "nothing to ramp"),
    (["--train-samples", "100", "--rampup-batch-size", "6", "4", "300"], "not a multiple of the increment 4"),
    (["--train-samples", "100", "--rampup-batch-size", "4", "4", "0"], "must be positive"),
])  # fmt: skip
def test_refusals_say_what_to_change(flags, message):
    with pytest.raises(ConfigError, match=message):
        build_config(None, ["--global-batch-size", "16", "--mock-data", *flags])


def test_an_explicit_zero_warmup_is_megatrons_and_accepted():
    assert build_config(None, ["--train-samples", "1000", "--lr-warmup-iters", "0", "--mock-data"]).train.lr_warmup_iters == 0


def test_every_batch_of_the_ramp_must_split_into_micro_batches_before_the_first_step():
    cfg = build_config(None, ["--global-batch-size", "16", "--micro-batch-size", "2", "--rampup-batch-size", "4", "4", "300",
                              "--train-samples", "1000", "--mock-data", "--num-layers", "4"])  # fmt: skip
    validate(cfg, world_size=2)  # 4, 8, 12, 16 over 2 x 2
    with pytest.raises(ConfigError, match=r"the global batches \[4, 12\] are not multiples of .* = 8"):
        validate(cfg, world_size=4)
    cfg.parallel.pipeline_parallel, cfg.parallel.virtual_pipeline_parallel, cfg.train.micro_batch_size = 2, 2, 4
    with pytest.raises(ConfigError, match=r"global batches \[4, 12\] give micro-batch counts that are not multiples of pp 2"):
        validate(cfg, world_size=2)  # dp 1, micro batches of 4: 1, 2, 3, 4 per step; interleaving needs even counts
