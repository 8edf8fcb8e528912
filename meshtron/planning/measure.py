"""``meshtron plan --measure K``: the top K layouts run through the real trainer for a few steps
each, predicted tokens/s set beside measured.

Each layout is one ``meshtron train`` under ``torchrun`` on this machine's GPUs with random tokens
(``--mock-data``), ``--train-iters`` steps logged every step; its tokens/s is the median of the
steps after the first two (start-up, first-call compilation), its memory the peak the log reports.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from meshtron.planning.layouts import Layout

TOKENS = re.compile(r"tokens/s/device ([\d,]+)")
MEMORY = re.compile(r"mem ([\d.]+) GiB")
CAUSE = re.compile(r"Error|error:|Exception|out of memory")


@dataclass
class Measurement:
    tokens_per_s_gpu: float  # 0: the run failed
    peak_gib: float
    error: str  # the run's last lines when it failed


def train_argv(base_args: list[str], layout: Layout, steps: int) -> list[str]:
    """The command that trains ``layout`` for ``steps`` steps on random tokens, logging each step."""
    launcher = [sys.executable, "-m", "meshtron"] if layout.world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(layout.world), "-m", "meshtron"]  # fmt: skip
    return [*launcher, "train", *base_args, *layout.flags(), "--mock-data", "--train-iters", str(steps), "--log-interval", "1",
            "--eval-interval", "0"]  # fmt: skip


def failure_lines(log: str) -> str:
    """The lines of a failed run's log that say why: the first rank error or exception and the two
    lines after it, not the launcher's summary of which rank exited (torchrun's names no cause)."""
    lines = [line for line in log.strip().splitlines() if "ChildFailedError" not in line and "elastic" not in line]
    first = next((i for i, line in enumerate(lines) if CAUSE.search(line)), max(0, len(lines) - 3))
    return "\n".join(lines[first : first + 3])


def run_until(cmd: list[str], timeout_s: float) -> tuple[int | None, str]:
    """(exit code, or None when it ran past ``timeout_s``; its output). A run past its time gets
    SIGTERM, on which torchrun stops its ranks (each in a session of its own: a SIGKILL to torchrun
    alone would leave them running, hung and holding their GPUs), then SIGKILL after 60 s. The
    output goes through a file, which a rank left behind cannot hold open as it would a pipe."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        return code, log.read()


def run_layout(base_args: list[str], layout: Layout, steps: int, timeout_s: float = 600.0) -> Measurement:
    """Train ``layout`` for ``steps`` steps and read its speed and memory off the log lines."""
    code, log = run_until(train_argv(base_args, layout, steps), timeout_s)
    if code is None:
        return Measurement(0.0, 0.0, f"no result within {timeout_s:.0f} s")
    speeds = [float(s.replace(",", "")) for s in TOKENS.findall(log)]
    peaks = [float(g) for g in MEMORY.findall(log)]
    if code or not speeds:
        return Measurement(0.0, max(peaks, default=0.0), failure_lines(log))
    kept = speeds[2:] or speeds[-1:]
    return Measurement(statistics.median(kept), max(peaks, default=0.0), "")


def measure_top(result, base_args: list[str], k: int, steps: int) -> str:
    """Run the top ``k`` of ``result`` (a ``search.PlanResult``) and print predicted against measured."""
    import torch

    gpus = torch.cuda.device_count()
    lines = [f"measured ({steps} steps each, median after the first two) against predicted:",
             f"  {'layout':<44} {'predicted':>10} {'measured':>10} {'error':>7} {'GiB est.':>8} {'GiB peak':>8}"]  # fmt: skip
    for verdict in result.fits[:k]:
        layout = verdict.layout
        if layout.world > gpus:
            lines.append(f"  {layout.short():<44} needs {layout.world} GPUs, this machine has {gpus}: not run")
            continue
        got = run_layout(base_args, layout, steps)
        predicted = verdict.prediction.tokens_per_s_gpu
        if not got.tokens_per_s_gpu:
            lines.append(f"  {layout.short():<44} {predicted:>10,.0f}     failed: {got.error}")
            continue
        error = predicted / got.tokens_per_s_gpu - 1
        lines.append(f"  {layout.short():<44} {predicted:>10,.0f} {got.tokens_per_s_gpu:>10,.0f} {100 * error:>+6.1f}% "
                     f"{verdict.memory_bytes / 2**30:>8.1f} {got.peak_gib:>8.1f}")  # fmt: skip
    return "\n".join(lines)
