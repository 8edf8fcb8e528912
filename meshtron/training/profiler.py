"""``--profile``: a PyTorch profiler trace of a few training steps (Megatron's
``--profile-step-start`` / ``--profile-step-end``), written under the run directory.

Why a window and not the whole run: a trace of every kernel of every step is large and slows the
steps it records, so it covers iterations ``[start, end)`` after the warm-up steps (allocator,
autotuning, compilation) that would otherwise dominate it. Only global rank 0 records, as
Megatron's ``--profile-ranks`` default does. The trace is a Chrome/Perfetto JSON file in
``<run dir>/profile/``, where the run directory is ``--tensorboard-dir`` or else ``--save``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch


def profile_dir(logging_cfg, save_dir: str) -> Path | None:
    """Where the trace goes; None when the run has no directory (validation refuses that)."""
    root = logging_cfg.tensorboard_dir or save_dir
    return Path(root) / "profile" if root else None


class StepProfiler:
    """Starts the profiler before iteration ``profile_step_start`` and writes the trace before
    ``profile_step_end`` (or at ``close`` when training stops earlier). Does nothing unless
    ``--profile`` is set and this is rank 0."""

    def __init__(self, logging_cfg, save_dir: str, rank: int, log: Callable[[str], None]):
        self.start, self.end = logging_cfg.profile_step_start, logging_cfg.profile_step_end
        self.dir = profile_dir(logging_cfg, save_dir) if logging_cfg.profile and rank == 0 else None
        self.log = log
        self._profiler: torch.profiler.profile | None = None
        self._last = self.start

    def at(self, iteration: int) -> None:
        """Call before each iteration (0-based count of completed ones)."""
        if self.dir is None:
            return
        self._last = iteration
        if iteration == self.start and self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
            self._profiler.__enter__()
        elif iteration == self.end:
            self.close(iteration)

    def close(self, iteration: int | None = None) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        end = self._last + 1 if iteration is None else iteration
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"trace_rank0_iters_{self.start}-{end}.json"
        self._profiler.export_chrome_trace(str(path))
        self._profiler = None
        self.log(f"profile of iterations [{self.start}, {end}) written to {path}")
