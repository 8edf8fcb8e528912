"""Throughput accounting (MFU against two peaks; FLOPs are counted by ``models.flops``) and the per-interval log line."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

from meshtron.training.peak_flops import datasheet_peak_tflops

# Measured bf16 GEMM ceilings (8192^3, random data), TFLOP/s; see ../shared/BENCHMARKS.md. MFU is
# reported against these and against the datasheet peak (``peak_flops.py``), each named.
MEASURED_BF16_CEILING_TFLOPS = {"H100": 762.0, "H200": 788.0}


@dataclass(frozen=True)
class MfuBase:
    """One denominator of MFU: its name in the log and in benchmarks' tables, TFLOP/s (None:
    unknown, no MFU against it), and where the number came from."""

    name: str
    tflops: float | None
    source: str


def mfu_bases(device: torch.device) -> tuple[MfuBase, MfuBase]:
    """MFU's two denominators: ``peak``, the datasheet dense bf16 peak (what Megatron-LM and
    torchtitan divide by; ``MESHTRON_PEAK_TFLOPS`` sets it, on the CPU too), and ``ceiling``, the
    bf16 GEMM throughput measured on the chip (``MEASURED_BF16_CEILING_TFLOPS``)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak, peak_source = datasheet_peak_tflops(name)
    if device.type != "cuda" and peak is None:
        peak_source = "none (CPU)"
    ceiling, ceiling_source = None, "none (CPU)" if device.type != "cuda" else f"not measured for {name}"
    for key, value in MEASURED_BF16_CEILING_TFLOPS.items():
        if key in name:
            ceiling, ceiling_source = value, f"measured bf16 GEMM ceiling of {key}"
            break
    return MfuBase("peak", peak, peak_source), MfuBase("ceiling", ceiling, ceiling_source)


def describe_bases(bases: tuple[MfuBase, ...]) -> str:
    """``peak 989 TFLOP/s (datasheet ...); ceiling 762 TFLOP/s (measured ...)`` for a run's first lines."""
    return "; ".join(f"{b.name} {b.tflops:g} TFLOP/s ({b.source})" if b.tflops else f"{b.name} {b.source}" for b in bases)


@dataclass
class IntervalMeter:
    """Accumulates steps between two log lines and times them with a host clock.

    The clock is read after a device sync only when the interval's steps end (``pause``, called by
    ``summary`` and before evaluation or a save), not after every step: a sync per step would
    make the host wait for the optimizer's kernels at every step's end, and the GPU then wait for
    the next step's first launches. Tokens are counted per device (the global batch's tokens
    over the world size)."""

    flops_per_token: float
    bases: tuple[MfuBase, ...]  # MFU against each that has a number (``mfu_bases``)
    device: torch.device
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    skipped: int = 0
    _start: float | None = field(default=None, repr=False)  # when the running stretch of steps began

    def start_step(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def pause(self) -> None:
        """Count the time of the steps so far (their device work included): what follows is not training."""
        if self._start is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - self._start
        self._start = None

    def end_step(self, tokens: int, skipped: bool) -> None:
        self.steps += 1
        self.tokens += tokens
        self.skipped += int(skipped)

    def summary(self) -> dict[str, float]:
        self.pause()
        seconds = max(self.seconds, 1e-9)
        tokens_per_s = self.tokens / seconds
        tflops = tokens_per_s * self.flops_per_token / 1e12
        out = {
            "ms_per_iter": 1000.0 * seconds / max(self.steps, 1),
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "skipped": self.skipped,
        }
        for base in self.bases:
            if base.tflops:
                out[f"mfu_{base.name}"] = tflops / base.tflops
        if self.device.type == "cuda":
            out["mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.steps = self.tokens = self.skipped = 0
        self.seconds = 0.0
        return out


def format_log_line(iteration: int, train_iters: int, consumed: int, lr: float, loss: float, grad_norm: float, loss_scale: float,
                    stats: dict[str, float], aux: dict[str, float] | None = None, batch_size: int = 0) -> str:  # fmt: skip
    """Megatron's log line, plus tokens/s, TFLOP/s per device, MFU against each base (``MFU 51.2% of
    peak, 66.4% of ceiling``) and memory, and each kind of
    auxiliary loss summed over layers (``aux`` is per term, ``kind/layer``: TensorBoard gets those).
    ``batch_size``: the step's global batch (it varies under --rampup-batch-size); 0 leaves it out."""
    parts = [
        f"iteration {iteration:>7d}/{train_iters}",
        f"consumed samples {consumed:>10d}",
        *([f"global batch size {batch_size:>5d}"] if batch_size else []),
        f"ms/iter {stats['ms_per_iter']:8.1f}",
        f"lr {lr:.3e}",
        f"loss {loss:.4f}",
        f"grad norm {grad_norm:.3f}" if math.isfinite(grad_norm) else f"grad norm {grad_norm}",
        f"loss scale {loss_scale:g}",
        f"tokens/s/device {stats['tokens_per_s']:,.0f}",
        f"TFLOP/s/device {stats['tflops_per_device']:.2f}",
    ]
    mfu = [f"{100 * value:.1f}% of {key.removeprefix('mfu_')}" for key, value in stats.items() if key.startswith("mfu_")]
    if mfu:
        parts.append("MFU " + ", ".join(mfu))
    if "mem_gib" in stats:
        parts.append(f"mem {stats['mem_gib']:.2f} GiB")
    if stats.get("skipped"):
        parts.append(f"skipped {int(stats['skipped'])}")
    totals: dict[str, float] = {}
    for name, value in (aux or {}).items():
        kind = name.split("/")[0]
        totals[kind] = totals.get(kind, 0.0) + value
    parts.extend(f"{kind} {value:.4g}" for kind, value in sorted(totals.items()))
    return " | ".join(parts)


def memory_scalars(stats: dict[str, float]) -> dict[str, float]:
    """Memory for TensorBoard: the GPU's peak allocation where there is one, and always the
    process's peak resident memory (what a CPU run uses)."""
    import resource

    out = {"perf/host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}
    if "mem_gib" in stats:
        out["perf/gpu_mem_gib"] = stats["mem_gib"]
    return out


class MetricsWriter:
    """Scalars to TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``),
    each only when asked for; built with ``None`` (ranks other than 0) it writes nothing.

    W&B reads its own environment (``WANDB_MODE=offline``, ``WANDB_API_KEY``), so offline runs
    write under ``--wandb-save-dir`` for a later ``wandb sync``.
    """

    def __init__(self, cfg=None):
        self._tensorboard = self._wandb = None
        log = cfg.logging if cfg is not None else None
        if log is not None and log.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=log.tensorboard_dir, max_queue=log.tensorboard_queue_size)
        if log is not None and log.wandb_project:
            import wandb  # validation has checked that it is installed

            if log.wandb_save_dir:
                os.makedirs(log.wandb_save_dir, exist_ok=True)
            self._wandb = wandb.init(project=log.wandb_project, name=log.wandb_exp_name or None,
                                     dir=log.wandb_save_dir or None, config=cfg.to_dict())  # fmt: skip

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
