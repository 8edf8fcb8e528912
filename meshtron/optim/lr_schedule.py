"""Learning-rate schedule: linear warmup, then constant / linear / cosine / WSD decay (Megatron's).

The schedule is a pure function of the iteration, so resuming needs no schedule state beyond the
iteration count the checkpoint already holds; ``state_dict`` exists only so a resumed run can check
that it was given the same schedule.

Step numbering: ``lr_at(i)`` is the rate for the optimizer step taken when ``i`` steps are already
done (``i`` is 0-based; the first step is ``lr_at(0)``). Megatron evaluates its formulas at the
number of steps *after* the current one, ``n = i + 1``, except that its first step runs at
``n = 0`` (lr 0 during warmup), which wastes a step. We evaluate every formula at ``n = i + 1``:
the first step uses ``max_lr / warmup_iters``, step ``warmup_iters - 1`` reaches ``max_lr``, and
step ``decay_iters - 1`` (the last of a run whose ``decay_iters == train_iters``) reaches
``min_lr`` exactly.

Sample-based training (``--train-samples``) counts every span in samples, as Megatron does
(``--lr-warmup-samples``, ``--lr-decay-samples``, ``--lr-wsd-decay-samples``), and its formulas
take the samples consumed once the step is done: ``lr_at(consumed, batch)`` evaluates them at
``n = consumed + batch``, the same rule (a run of constant batch B with spans of k x B samples
has the rates of spans of k iterations).
"""

from __future__ import annotations

import math
from typing import Any

STYLES = ("constant", "linear", "cosine", "wsd")
UNITS = ("iterations", "samples")


class LRSchedule:
    """lr(i) for i = completed steps (or samples); see the module docstring for the exact numbering.
    The spans (``warmup_iters``, ``decay_iters``, ``wsd_decay_iters``) are counted in ``unit``."""

    def __init__(
        self,
        max_lr: float,
        min_lr: float,
        warmup_iters: int,
        decay_iters: int,
        style: str,
        wsd_decay_iters: int = 0,
        unit: str = "iterations",
    ) -> None:
        if style not in STYLES:
            raise ValueError(f"lr decay style must be one of {', '.join(STYLES)}, got '{style}'")
        if not 0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr {min_lr}, max_lr {max_lr}")
        if warmup_iters < 0 or decay_iters <= 0:
            raise ValueError(f"need warmup_iters >= 0 and decay_iters > 0, got {warmup_iters} and {decay_iters}")
        if unit not in UNITS:
            raise ValueError(f"the schedule counts {' or '.join(UNITS)}, got '{unit}'")
        if wsd_decay_iters < 0:
            raise ValueError(f"wsd_decay_iters must not be negative, got {wsd_decay_iters}")
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_iters = int(warmup_iters)
        self.decay_iters = int(decay_iters)
        self.style = style
        self.wsd_decay_iters = int(wsd_decay_iters)
        self.unit = unit
        # Megatron has no default for the WSD anneal length; 10% of the decay span is the common choice.
        self._wsd_anneal = self.wsd_decay_iters or max(1, self.decay_iters // 10)

    @classmethod
    def decoupled_from_config(cls, train_cfg: Any) -> "LRSchedule | None":
        """``--decoupled-lr``'s schedule (the word embeddings' and output layer's): ``from_config``'s
        spans and style from ``--decoupled-lr`` to ``--decoupled-min-lr``; None without it."""
        t = train_cfg
        if not t.decoupled_lr:
            return None
        main = cls.from_config(t)
        return cls(t.decoupled_lr, t.decoupled_min_lr, main.warmup_iters, main.decay_iters, main.style, main.wsd_decay_iters, main.unit)

    @classmethod
    def from_config(cls, train_cfg: Any) -> "LRSchedule":
        """Build from a ``TrainConfig``; ``lr_decay_iters == 0`` means decay over the whole run.
        Under ``--train-samples`` the spans are its sample counts (``lr_decay_samples == 0``: all of them).
        ``--lr-warmup-fraction`` sets the warm-up to that fraction of the decay span, rounded to a
        whole count (Megatron keeps the product unrounded)."""
        t = train_cfg
        if t.train_samples:
            decay = t.lr_decay_samples or t.train_samples
            return cls(t.lr, t.min_lr, _warmup(t, decay, t.lr_warmup_samples), decay, t.lr_decay_style, t.lr_wsd_decay_samples,
                       unit="samples")  # fmt: skip
        decay = t.lr_decay_iters or t.train_iters
        return cls(t.lr, t.min_lr, _warmup(t, decay, t.lr_warmup_iters), decay, t.lr_decay_style, t.lr_wsd_decay_iters)

    def lr_for_step(self, iteration: int, consumed_samples: int, batch_size: int) -> float:
        """Rate for the step taken after ``iteration`` steps that consumed ``consumed_samples``,
        itself training ``batch_size`` samples: ``lr_at`` in the schedule's unit."""
        return self.lr_at(consumed_samples, batch_size) if self.unit == "samples" else self.lr_at(iteration)

    def lr_at(self, done: int, step: int = 1) -> float:
        """Rate for the step taken after ``done`` completed steps (or samples), itself ``step`` of them.

        A warmup longer than the decay span (a short test run with the default warmup) is allowed,
        as Megatron's formulas allow it: the rate rises until warmup ends or the run stops, and
        after ``decay_iters`` it is ``min_lr`` (``max_lr`` for the constant style, as in Megatron).
        """
        n = done + step
        if self.warmup_iters > 0 and n <= self.warmup_iters:
            return self.max_lr * n / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if n > self.decay_iters:
            return self.min_lr
        if self.style == "wsd":
            anneal_start = self.decay_iters - self._wsd_anneal
            if n <= anneal_start:
                coeff = 1.0
            else:
                coeff = 1.0 - (n - anneal_start) / self._wsd_anneal
        else:
            ratio = (n - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
            coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def state_dict(self) -> dict[str, Any]:
        """The parameters (JSON-ready), for a resumed run to compare with its own."""
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_iters": self.warmup_iters,
            "decay_iters": self.decay_iters,
            "style": self.style,
            "wsd_decay_iters": self.wsd_decay_iters,
            "unit": self.unit,
        }


def _warmup(t: Any, decay: int, count: int) -> int:
    """The warm-up span: ``--lr-warmup-fraction`` of the decay span where given, else ``count``."""
    return round(t.lr_warmup_fraction * decay) if t.lr_warmup_fraction else count
