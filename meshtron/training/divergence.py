"""Stop a run that diverged, instead of training (and checkpointing) garbage to the end.

Checked every step from numbers the step already has (the loss, summed over data-parallel ranks,
and the global gradient norm), so every rank reaches the same verdict at the same iteration and
none is left waiting in a collective:

- bf16 / fp32: a non-finite loss or gradient norm stops the run at once
  (``--check-for-nan-in-loss-and-grad``, Megatron's flag, on by default).
- fp16: an overflowing step is skipped and the loss scale backs off; that is normal, so only
  ``train.max_consecutive_skipped_steps`` skipped steps in a row stop the run (the scale is then
  not recovering). The limit applies in every precision, as a backstop when the check is off.

Stopping raises ``DivergenceError`` (the CLI exits non-zero); the trainer saves nothing after it,
so the last good checkpoint stays the newest. To name where the first non-finite value arose, the
step's micro batches are run forward again through the runner with a hook on every module of this
rank (only on the failing step; every rank reaches the verdict together, so pipeline stages run
the re-run in step). Dropout draws differ in the re-run, so the module named is where the
*re-run* first goes non-finite.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from meshtron.config import TrainConfig
from meshtron.errors import DivergenceError


class DivergenceMonitor:
    """``check`` after every optimizer step; it keeps the one piece of history needed, the
    number of skipped steps in a row."""

    def __init__(self, check_nan: bool, max_skipped: int, loss_scaling: bool, rank: int, model: nn.Module):
        self.check_nan, self.max_skipped, self.loss_scaling = check_nan, max_skipped, loss_scaling
        self.rank, self.model = rank, model
        self.skipped_in_a_row = 0

    @classmethod
    def from_config(cls, t: TrainConfig, precision: str, rank: int, model: nn.Module) -> DivergenceMonitor:
        return cls(t.check_for_nan_in_loss_and_grad, t.max_consecutive_skipped_steps, precision == "fp16", rank, model)

    def check(self, iteration: int, loss: float, step: Any, rerun: Callable[[], Any] | None = None) -> None:
        """After each step: raise ``DivergenceError`` when the run must stop. ``step`` is the
        optimizer's ``StepResult``; ``rerun`` repeats the step's forward passes (None: don't locate)."""
        finite = math.isfinite(loss) and math.isfinite(step.grad_norm)
        skipped = step.skipped or not finite
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        numbers = f"loss {loss}, grad norm {step.grad_norm}"
        if self.check_nan and not finite and not self.loss_scaling:
            bad = " and ".join(name for name, value in (("loss", loss), ("grad norm", step.grad_norm)) if not math.isfinite(value))
            reason = f"non-finite {bad} ({numbers}; --no-check-for-nan-in-loss-and-grad turns this check off)"
        elif self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
            reason = (f"{self.skipped_in_a_row} consecutive steps skipped ({numbers}, loss scale {step.loss_scale}; "
                      "the limit is --max-consecutive-skipped-steps)")  # fmt: skip
        else:
            return
        where = self._locate(rerun) if rerun is not None else "not located"
        raise DivergenceError(
            f"training diverged at iteration {iteration} on rank {self.rank}: {reason}; first module with a non-finite "
            f"output: {where}. Nothing was saved after the divergence: resume from the last checkpoint with a lower "
            "--lr, more --lr-warmup-iters or a tighter --clip-grad"
        )

    def _locate(self, rerun: Callable[[], Any]) -> str:
        name = first_nonfinite_module(self.model, rerun)
        return name if name is not None else "none in the forward pass (the non-finite values arise in the backward pass)"


@torch.no_grad()
def first_nonfinite_module(model: nn.Module, rerun: Callable[[], Any]) -> str | None:
    """Run ``rerun()`` (forward passes of ``model``) with a forward hook on every module and
    return the name of the first whose output holds a NaN or Inf. Hooks fire as modules finish,
    innermost first, so the first hit is the module that produced the value, not a container.
    ``rerun`` runs to the end even after a hit, so that ranks running it together stay in step."""
    names = {module: name or "(the whole model)" for name, module in model.named_modules()}
    found: list[str] = []

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        if not found and _nonfinite(output):
            found.append(names[module])

    handles = [module.register_forward_hook(hook) for module in names]
    try:
        rerun()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def _nonfinite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and not bool(torch.isfinite(value).all())
    if isinstance(value, (tuple, list)):
        return any(_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(_nonfinite(v) for v in value.values())
    return False
