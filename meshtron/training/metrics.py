"""Throughput accounting (one FLOP-count function for everything) and the per-interval log line."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

# Measured bf16 GEMM ceilings (8192^3, random data), TFLOP/s; see ../shared/BENCHMARKS.md.
# MFU is reported against these, never against a datasheet number.
MEASURED_BF16_CEILING_TFLOPS = {"H100": 762.0, "H200": 788.0}
# AMD Instinct GPUs have no measured ceiling yet (none here): their datasheet dense bf16 peaks per
# device PyTorch sees (an MI250X shows as two, one per die), and the log line says so.
AMD_DATASHEET_BF16_TFLOPS = {"MI300X": 1307.4, "MI325X": 1307.4, "MI250X": 191.5}


def flops_per_token(num_params: int, num_layers: int, seq_length: int, hidden_size: int, causal: bool = True) -> float:
    """Training FLOPs per token of a causal decoder: ``6 P + 6 L S h``.

    ``6 P``: forward (2) and backward (4) through every parameter, the tied embedding counted once
    as the output projection. ``6 L S h``: the attention score and value products, halved for
    causality (12 L S h / 2); an encoder (``causal=False``) attends to every key: ``12 L S h``.
    The one place the project counts FLOPs.
    """
    return 6.0 * num_params + (6.0 if causal else 12.0) * num_layers * seq_length * hidden_size


def model_flops_per_token(model_cfg, vocab_size: int, seq_length: int, decoder_seq_length: int = 0) -> float:
    """``flops_per_token`` of a model config, with ``P`` the parameters that multiply a token's
    activations and ``L`` the layers it attends through (``models.flops_shape``: lookups such as
    an untied input embedding and learned positions carry no FLOPs, a tied table counts once as the
    output projection, mixture-of-experts layers their active experts; the peers' convention in
    ../shared/BENCHMARKS.md). T5: per encoder or decoder token (``encoder_decoder_flops_per_token``)."""
    from meshtron.models import attends_causally, flops_shape

    if model_cfg.model_type == "t5":
        return encoder_decoder_flops_per_token(model_cfg, vocab_size, seq_length, decoder_seq_length)
    params, layers = flops_shape(model_cfg, vocab_size, seq_length)
    return flops_per_token(params, layers, seq_length, model_cfg.hidden_size, attends_causally(model_cfg))


def encoder_decoder_flops_per_token(model_cfg, vocab_size: int, encoder_length: int, decoder_length: int) -> float:
    """T5's training FLOPs of one sample over its ``encoder_length + decoder_length`` tokens, by
    the rules of ``flops_per_token``: 6 per parameter and token it multiplies (encoder blocks and
    the cross-attention's key/value projections on encoder tokens; decoder blocks, the rest of the
    cross-attention and the output projection on decoder tokens), bidirectional attention in the
    encoder (12 L t^2 h), causal self-attention (6 L s^2 h) and cross-attention (12 L s t h) in
    the decoder."""
    from meshtron.config import encoder_decoder_layers
    from meshtron.models.t5 import t5_parameter_parts

    part, h = t5_parameter_parts(model_cfg), model_cfg.hidden_size
    (enc, dec), t, s = encoder_decoder_layers(model_cfg), encoder_length, decoder_length
    linear = t * (enc * part["block"] + dec * part["cross_kv"]) + s * (dec * (part["block"] + part["cross_q"]) + vocab_size * h)
    attention = 12.0 * enc * t * t * h + 6.0 * dec * s * s * h + 12.0 * dec * s * t * h
    return (6.0 * linear + attention) / (t + s)


def sample_tokens(cfg) -> int:
    """Tokens of one training sample: the sequence, and T5's decoder sequence besides."""
    return cfg.data.seq_length + (cfg.data.decoder_seq_length if cfg.model.model_type == "t5" else 0)


def device_ceiling_tflops(device: torch.device) -> tuple[float | None, str]:
    """The bf16 GEMM ceiling used for MFU, and where it came from."""
    override = os.environ.get("MESHTRON_PEAK_TFLOPS")
    if override:
        return float(override), "MESHTRON_PEAK_TFLOPS"
    if device.type != "cuda":
        return None, "none (CPU)"
    name = torch.cuda.get_device_name(device)
    for key, value in MEASURED_BF16_CEILING_TFLOPS.items():
        if key in name:
            return value, f"measured bf16 GEMM ceiling of {key}"
    for key, value in AMD_DATASHEET_BF16_TFLOPS.items():
        if key in name:
            return value, f"datasheet bf16 peak of {key} (not measured)"
    return None, f"unknown for {name} (set MESHTRON_PEAK_TFLOPS)"


@dataclass
class IntervalMeter:
    """Accumulates steps between two log lines and times them with a host clock.

    The clock is read after a device sync only when the interval's steps end (``pause``, called by
    ``summary`` and before evaluation or a save), not after every step: a sync per step would
    make the host wait for the optimizer's kernels at every step's end, and the GPU then wait for
    the next step's first launches. Tokens are counted per device (the global batch's tokens
    over the world size)."""

    flops_per_token: float
    ceiling_tflops: float | None
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
        if self.ceiling_tflops:
            out["mfu"] = tflops / self.ceiling_tflops
        if self.device.type == "cuda":
            out["mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.steps = self.tokens = self.skipped = 0
        self.seconds = 0.0
        return out


def format_log_line(iteration: int, train_iters: int, consumed: int, lr: float, loss: float, grad_norm: float, loss_scale: float,
                    stats: dict[str, float], aux: dict[str, float] | None = None) -> str:  # fmt: skip
    """Megatron's log line, plus tokens/s, TFLOP/s per device, MFU and memory, and each kind of
    auxiliary loss summed over layers (``aux`` is per term, ``kind/layer``: TensorBoard gets those)."""
    parts = [
        f"iteration {iteration:>7d}/{train_iters}",
        f"consumed samples {consumed:>10d}",
        f"ms/iter {stats['ms_per_iter']:8.1f}",
        f"lr {lr:.3e}",
        f"loss {loss:.4f}",
        f"grad norm {grad_norm:.3f}" if math.isfinite(grad_norm) else f"grad norm {grad_norm}",
        f"loss scale {loss_scale:g}",
        f"tokens/s/device {stats['tokens_per_s']:,.0f}",
        f"TFLOP/s/device {stats['tflops_per_device']:.2f}",
    ]
    if "mfu" in stats:
        parts.append(f"MFU {100 * stats['mfu']:.1f}%")
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
