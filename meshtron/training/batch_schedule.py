"""Training counted in samples (Megatron's ``--train-samples``) and a global batch that ramps up
with them (``--rampup-batch-size START INCREMENT RAMP_SAMPLES``).

The ramp is Megatron's (``RampupBatchsizeNumMicroBatchesCalculator``): the global batch starts at
START and grows by INCREMENT each time another ``RAMP_SAMPLES / ((GLOBAL - START) / INCREMENT)``
samples are consumed, and is ``--global-batch-size`` once more than RAMP_SAMPLES are. A step's
batch follows from the samples consumed before it, so a run resumed from a checkpoint's
consumed-sample count continues the ramp exactly. A batch runs as batch / (micro batch x data
parallel) micro batches; the samples themselves are read in the same order whatever the batch.

Sample-based training is Megatron's too: the iterations are those its ``update_train_iters``
counts (the ramp's steps, then whole global batches; a partial last batch is dropped), and the
iteration flags (``--train-iters``, ``--lr-decay-iters``, ``--lr-warmup-iters``) are refused
beside it, as the sample flags are without it.
"""

from __future__ import annotations

from typing import Any

from meshtron.errors import ConfigError

ITERATION_FLAGS = {"train_iters": "--train-iters", "lr_decay_iters": "--lr-decay-iters", "lr_warmup_iters": "--lr-warmup-iters",
                   "lr_wsd_decay_iters": "--lr-wsd-decay-iters"}  # fmt: skip
SAMPLE_FLAGS = {"rampup_batch_size": "--rampup-batch-size", "lr_decay_samples": "--lr-decay-samples",
                "lr_warmup_samples": "--lr-warmup-samples", "lr_wsd_decay_samples": "--lr-wsd-decay-samples"}  # fmt: skip


class BatchSchedule:
    """The global batch of the step that starts after ``consumed`` samples: constant, or Megatron's ramp."""

    def __init__(self, global_batch_size: int, rampup: list[int] | tuple[int, ...] = ()):
        self.global_batch_size = global_batch_size
        self.start, self.increment, self.ramp_samples = rampup if rampup else (global_batch_size, 0, 0)
        if rampup:  # Megatron's float, so the steps fall on the same samples as there
            self.samples_per_increment = self.ramp_samples / ((global_batch_size - self.start) // self.increment)

    @classmethod
    def from_config(cls, t: Any) -> "BatchSchedule":
        """From a ``TrainConfig`` whose ``rampup_batch_size`` passed ``rampup_errors``."""
        return cls(t.global_batch_size, tuple(t.rampup_batch_size))

    @property
    def ramps(self) -> bool:
        return self.start != self.global_batch_size

    def batch_at(self, consumed: int) -> int:
        if not self.ramps or consumed > self.ramp_samples:
            return self.global_batch_size
        return self.start + int(consumed / self.samples_per_increment) * self.increment

    def sizes(self) -> list[int]:
        """Every global batch the schedule can use, smallest first."""
        return list(range(self.start, self.global_batch_size, self.increment)) + [self.global_batch_size] if self.ramps else [self.global_batch_size]

    def describe(self) -> str:
        if not self.ramps:
            return f"global batch {self.global_batch_size}"
        return (f"global batch ramps from {self.start} by {self.increment} every {self.samples_per_increment:g} samples "
                f"to {self.global_batch_size} (reached after {self.ramp_samples} samples)")  # fmt: skip


def iterations_for_samples(train_samples: int, schedule: BatchSchedule) -> int:
    """Megatron's ``update_train_iters``: the ramp's steps while at most RAMP_SAMPLES (and at most
    ``train_samples``) are consumed, then the whole global batches that fit in the rest."""
    if not schedule.ramps:
        return train_samples // schedule.global_batch_size
    iterations = consumed = 0
    while consumed <= schedule.ramp_samples and consumed <= train_samples:
        consumed += schedule.batch_at(consumed)
        iterations += 1
    return iterations + max(0, train_samples - consumed) // schedule.global_batch_size


def rampup_errors(t: Any) -> list[str]:
    """Megatron's checks of ``--rampup-batch-size`` (and the two it fails on by dividing by zero)."""
    if not t.rampup_batch_size:
        return []
    if len(t.rampup_batch_size) != 3:
        return [f"--rampup-batch-size takes 3 values, START INCREMENT RAMP_SAMPLES; got {t.rampup_batch_size}"]
    start, increment, ramp_samples = t.rampup_batch_size
    errors = []
    if start <= 0 or increment <= 0 or ramp_samples <= 0:
        errors.append(f"--rampup-batch-size {start} {increment} {ramp_samples}: the start batch, the increment and the ramp's samples must be positive")
    elif start >= t.global_batch_size:
        errors.append(f"--rampup-batch-size starts at {start}, not below --global-batch-size {t.global_batch_size}: nothing to ramp; "
                      "lower the start or drop --rampup-batch-size")  # fmt: skip
    elif (t.global_batch_size - start) % increment:
        errors.append(f"--rampup-batch-size: the ramp from {start} to --global-batch-size {t.global_batch_size} is not a multiple "
                      f"of the increment {increment}")  # fmt: skip
    return errors


def batch_schedule_errors(t: Any, dp: int, interleaved_pp: int) -> list[str]:
    """Every batch on the ramp must split into whole micro batches over the data-parallel ranks (and
    into a multiple of pp of them for the interleaved schedule; ``interleaved_pp`` 0 otherwise).
    Megatron checks each batch when it is reached; here a wrong ramp fails before the first step."""
    errors = rampup_errors(t)
    if errors or not t.rampup_batch_size or t.micro_batch_size <= 0:
        return errors
    per_micro = t.micro_batch_size * dp
    sizes = BatchSchedule.from_config(t).sizes()
    bad = [b for b in sizes if b % per_micro]
    if bad:
        errors.append(f"--rampup-batch-size: the global batches {bad} are not multiples of --micro-batch-size {t.micro_batch_size} "
                      f"x data-parallel size {dp} = {per_micro}; make the start and the increment multiples of it")  # fmt: skip
    elif interleaved_pp and (odd := [b for b in sizes if (b // per_micro) % interleaved_pp]):
        errors.append(f"--rampup-batch-size: the global batches {odd} give micro-batch counts that are not multiples of pp "
                      f"{interleaved_pp}, which the interleaved schedule needs; make the start and the increment multiples of "
                      f"{per_micro * interleaved_pp}")  # fmt: skip
    return errors


def resolve_sample_based_training(t: Any, given: set[str]) -> None:
    """Megatron's rules for sample-based training on a ``TrainConfig`` whose explicitly ``given``
    fields are named: with ``--train-samples`` no iteration flag, and ``train_iters`` becomes the
    iterations it takes (the default warm-up of 30 iterations does not apply); without it no
    sample flag. ``--lr-warmup-fraction`` (Megatron's) sets the warm-up instead of either count,
    never beside one. Raises ``ConfigError`` saying what to drop."""
    if t.lr_warmup_fraction:
        if not 0 < t.lr_warmup_fraction <= 1:
            raise ConfigError(f"--lr-warmup-fraction must be in (0, 1] (0: off), got {t.lr_warmup_fraction}")
        counts = [flag for name, flag in (("lr_warmup_iters", "--lr-warmup-iters"), ("lr_warmup_samples", "--lr-warmup-samples"))
                  if name in given]  # fmt: skip
        if counts:
            raise ConfigError(f"--lr-warmup-fraction and {' and '.join(counts)} both set the warm-up; keep one")
        t.lr_warmup_iters = 0  # the default count does not apply either
    if not t.train_samples and "train_samples" not in given:
        named = [flag for name, flag in SAMPLE_FLAGS.items() if getattr(t, name)]
        if named:
            raise ConfigError(f"{', '.join(named)} count samples: add --train-samples (sample-based training, in place of "
                              f"--train-iters), or use the iteration flags")  # fmt: skip
        return
    if t.train_samples <= 0:
        raise ConfigError(f"--train-samples must be positive, got {t.train_samples}")
    clash = [flag for name, flag in ITERATION_FLAGS.items() if name in given and (getattr(t, name) or name == "train_iters")]
    if clash:
        raise ConfigError(f"--train-samples counts the run in samples; drop {', '.join(clash)} (use --lr-decay-samples, "
                          f"--lr-warmup-samples, --lr-wsd-decay-samples for the schedule)")  # fmt: skip
    errors = rampup_errors(t)
    if errors:
        raise ConfigError("; ".join(errors))
    t.lr_warmup_iters = 0
    t.train_iters = iterations_for_samples(t.train_samples, BatchSchedule.from_config(t))
    if t.train_iters == 0:
        raise ConfigError(f"--train-samples {t.train_samples} is less than one global batch ({t.global_batch_size}); raise it")


def planned_samples(t: Any) -> int:
    """The samples the training data is drawn for: Megatron's --train-samples, else iterations x batch."""
    return t.train_samples or t.train_iters * t.global_batch_size
