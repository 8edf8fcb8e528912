"""What a run frees between steps, as Megatron's flags ask: Python's garbage (``--manual-gc``) and the
CUDA caching allocator's unused blocks (``--empty-unused-memory-level``).

``--manual-gc``: Python's automatic garbage collector off while training, collections at chosen
iterations instead.

Why: the automatic collector starts when allocation counts cross its thresholds, at a moment no
rank chooses. A full collection walks every tracked object (0.3 M in a two-block model on the CPU,
more in a large one) and holds the host for milliseconds to tenths of a second; on a host-bound
step the GPU waits, and with several ranks the others wait for the paused one at the next
collective. Collecting every ``--manual-gc-interval`` iterations happens at the same iteration on
every rank, so the pauses line up.

Unlike Megatron, the objects alive after the start-up collection (the model, the imported
libraries) are frozen (``gc.freeze``), so a later collection walks only what training allocated
since: 0.01 ms instead of ~130 ms for a full walk of 0.3 M objects on a 2-core host (RESULTS.md, the
eleventh session). A cycle among those start-up objects that dies during training waits for the end
of training, when the collector is unfrozen and its state restored.

``--empty-unused-memory-level``: 1 returns the allocator's unused cached blocks to the driver after
each forward-backward and each evaluation step, 2 also after each optimizer step (Megatron's
places). It costs allocations later; it helps where another process or a fragmented cache needs
the memory.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

from meshtron.config import TrainConfig

EMPTY_LEVELS = (0, 1, 2)


def release_errors(t: TrainConfig) -> list[str]:
    """What is wrong with the manual collection and cache-emptying flags."""
    errors = []
    if t.manual_gc_interval < 0:
        errors.append(f"--manual-gc-interval must be >= 0 (0: no collection between steps), got {t.manual_gc_interval}")
    elif t.manual_gc_interval and not t.manual_gc:
        errors.append(f"--manual-gc-interval {t.manual_gc_interval} takes effect only with --manual-gc (the automatic "
                      "collector runs otherwise); add --manual-gc or drop --manual-gc-interval")  # fmt: skip
    if t.empty_unused_memory_level not in EMPTY_LEVELS:
        errors.append(f"--empty-unused-memory-level must be 0, 1 or 2, got {t.empty_unused_memory_level}")
    return errors


def empty_unused_memory(t: TrainConfig, level: int) -> None:
    """Return the caching allocator's unused blocks to the driver where ``--empty-unused-memory-level``
    is ``level`` or more (a no-op before CUDA is initialized, so on the CPU)."""
    if t.empty_unused_memory_level >= level:
        torch.cuda.empty_cache()


class ManualCollection:
    """``--manual-gc`` over one training run: ``start`` turns the collector off, collects once and
    freezes what is left; ``after_step`` collects every ``interval`` iterations;
    ``around_evaluation`` collects before and after an evaluation (unless ``--no-manual-gc-eval``);
    ``stop`` unfreezes and restores the collector. Does nothing without ``--manual-gc``."""

    def __init__(self, t: TrainConfig):
        self.enabled, self.interval, self.at_evaluation = t.manual_gc, t.manual_gc_interval, t.manual_gc_eval
        self._was_enabled: bool | None = None

    def start(self) -> None:
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
            gc.freeze()

    def after_step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def around_evaluation(self) -> Iterator[None]:
        collect = self.enabled and self.at_evaluation
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect()

    def stop(self) -> None:
        if self._was_enabled is None:  # not started, or already stopped
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
