"""Loss scaling for fp16 training, with Megatron's hysteresis rule.

fp16 gradients underflow unless the loss is multiplied up before backward; the optimizer divides
the scale back out of the fp32 gradients. The dynamic scaler grows the scale after a window of
clean steps and backs off when a step overflows, but only after ``hysteresis`` overflows since the
last growth, so one stray overflow does not halve a scale that is otherwise right. bf16 and fp32
need no scaling and get ``ConstantLossScaler(1.0)``, so the optimizer has one code path.

State is plain Python numbers; the optimizer turns it into tensors for the checkpoint.
"""

from __future__ import annotations

from typing import Any


class ConstantLossScaler:
    """A fixed scale (1.0 for bf16/fp32); ``update`` does nothing."""

    def __init__(self, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """A fixed scale ignores overflows; the optimizer still skips the step."""

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep the configured scale: it comes from the config, not the run's history (as Megatron)."""


class DynamicLossScaler:
    """Megatron's ``DynamicGradScaler``: grow after ``growth_interval`` clean steps, back off on overflow.

    An overflow resets the clean-step count and spends one unit of hysteresis; once hysteresis is
    spent, this and every further overflow multiplies the scale by ``backoff_factor`` (never below
    ``min_scale``) until a growth refills it.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"need 0 < min_scale <= initial_scale, got {min_scale} and {initial_scale}")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor} and {backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"need growth_interval >= 1 and hysteresis >= 1, got {growth_interval} and {hysteresis}")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Accepts numbers or 0-d tensors (as a checkpoint gives them back)."""
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
