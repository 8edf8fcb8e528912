"""``--log-straggler``: which ranks are slow, and in what.

Each rank times the sections of its steps (waiting for data, the forward and the backward of
each micro batch, the optimizer with the rest of the gradient reduction, the whole step); at
every log interval the ranks' means are gathered (one small all-gather) and rank 0 logs the
ranks that spend the most time beyond the median rank in one section, and which section
(``report``). The runner interleaves forwards and backwards over micro batches and pipeline
stages, so it times each one where its schedule runs it (``pipeline.forward_backward``'s
``timed``); the pipeline's own sends and receives count in the step only. On a GPU each section
ends with a device synchronize so that its time is the device's, not the launch's: that costs
some overlap, which is why the report is off unless asked for.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

SECTIONS = ("data wait", "forward", "backward", "optimizer")
NOISE = 0.1  # excess under this fraction of the median step is not named: step times jitter that much


class StragglerTimes:
    """This rank's section times over the current log interval (``section`` is a no-op when off)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self.totals = dict.fromkeys(("step", *SECTIONS), 0.0)
        self.steps = 0

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.totals[name] += time.perf_counter() - start
        if name == "step":
            self.steps += 1

    def gather(self, world_size: int) -> list[dict[str, float]]:
        """Every rank's mean seconds per step by section (collective), and a fresh interval."""
        mine = {k: v / max(self.steps, 1) for k, v in self.totals.items()}
        self.totals = dict.fromkeys(self.totals, 0.0)
        self.steps = 0
        if world_size == 1:
            return [mine]
        everyone: list[dict[str, float] | None] = [None] * world_size
        dist.all_gather_object(everyone, mine)
        return everyone  # type: ignore[return-value]


def report(per_rank: list[dict[str, float]], count: int) -> tuple[str, dict[str, float]]:
    """The log line naming up to ``count`` slowest ranks, and the scalars for TensorBoard.

    A rank is slow by the time it spends in a section beyond the median rank's: collectives make
    every rank's step as long as the slowest one's, the others' extra time being spent waiting
    in the sections that communicate, where the straggler is the fastest. Against the median
    rank, the straggler alone stands out, in the section it is slow in (with two ranks the
    median is their mean, so the waiting rank shows as much excess in its waiting section)."""
    median = {k: statistics.median(r[k] for r in per_rank) for k in per_rank[0]}
    excess = {r: max(SECTIONS, key=lambda k: times[k] - median[k]) for r, times in enumerate(per_rank)}
    score = {r: per_rank[r][k] - median[k] for r, k in excess.items()}
    slowest = [r for r in sorted(score, key=score.get, reverse=True)[:count] if score[r] > NOISE * median["step"]]
    parts = [f"rank {r} +{1e3 * score[r]:.0f} ms in {excess[r]} ({1e3 * per_rank[r][excess[r]]:.0f} ms vs "
             f"{1e3 * median[excess[r]]:.0f} ms)" for r in slowest]  # fmt: skip
    line = (f"stragglers (mean per step, {len(per_rank)} ranks, median step {1e3 * median['step']:.0f} ms): "
            + (", ".join(parts) if parts else "none beyond the median rank"))  # fmt: skip
    top = max(score, key=score.get)
    scalars = {"straggler/excess_ms": 1e3 * max(score[top], 0.0), "straggler/slowest_rank": float(top)}
    for k in SECTIONS:  # which section spreads the ranks: its slowest rank against the median one
        tag = k.replace(" ", "_")
        scalars[f"straggler/{tag}_max_ms"] = 1e3 * max(r[k] for r in per_rank)
        scalars[f"straggler/{tag}_median_ms"] = 1e3 * median[k]
    return line, scalars
