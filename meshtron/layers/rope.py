"""Rotary position embeddings (RoPE), with Llama 3.1's frequency scaling.

Convention: "rotate half" (Hugging Face / Megatron-Core, non-interleaved): dimension ``i`` of a
head is paired with dimension ``i + head_dim/2``. Checkpoints from Meta's reference code (which
pairs adjacent dimensions) must have their q/k rows permuted on import, as HF's converter does.

The cos/sin tables are built and applied in fp32: in bf16, positions in the thousands would be
rounded to a handful of distinct angles, and that error grows with the sequence length.
"""

from __future__ import annotations

import math

import torch

from meshtron.kernels.rope import apply_rotary  # noqa: F401  (re-exported: applying the tables is a kernel)


def rope_frequencies(
    head_dim: int,
    max_positions: int,
    base: float = 10000.0,
    scaling: str = "",
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_positions: int = 8192,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, head_dim] in fp32, for positions 0..max_positions-1."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling == "llama3":
        inv_freq = _llama3_scaling(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_positions)
    elif scaling:
        raise ValueError(f"unknown rope scaling '{scaling}': use '' or 'llama3'")
    angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _llama3_scaling(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """Meta's ``apply_scaling`` (Llama 3.1), vectorized.

    Long wavelengths (beyond the original context) are slowed down by ``factor``; short ones are
    kept; those in between are blended so that the model's learned local attention is untouched
    while distant positions map into the range it was trained on.
    """
    low_freq_wavelen = original / low
    high_freq_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)

