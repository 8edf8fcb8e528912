"""Rotary position embeddings (RoPE), with Llama 3.1's and YaRN's frequency scaling.

Convention: "rotate half" (Hugging Face / Megatron-Core, non-interleaved): dimension ``i`` of a
head is paired with dimension ``i + head_dim/2``. Checkpoints from Meta's reference code (which
pairs adjacent dimensions) must have their q/k rows permuted on import, as HF's converter does.
DeepSeek's MLA checkpoints pair adjacent dimensions too, in HF's and Megatron's copies alike;
there MLA reorders the rope dims at run time (``deinterleave``), as Megatron-Core does.

The cos/sin tables are built and applied in fp32: in bf16, positions in the thousands would be
rounded to a handful of distinct angles, and that error grows with the sequence length.
"""

from __future__ import annotations

import math

import torch

from meshtron.config import ModelConfig
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
    *,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    mscale: float = 1.0,
    mscale_all_dim: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, head_dim] in fp32, for positions 0..max_positions-1.

    YaRN also scales both tables by its attention factor (``yarn_attention_factor``), as Hugging
    Face and Megatron do: q and k each carry it, so their scores carry its square.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    attention_factor = 1.0
    if scaling == "llama3":
        inv_freq = _llama3_scaling(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_positions)
    elif scaling == "yarn":
        inv_freq = _yarn_scaling(inv_freq, base, factor, original_max_positions, beta_fast, beta_slow)
        attention_factor = yarn_attention_factor(factor, mscale, mscale_all_dim)
    elif scaling:
        raise ValueError(f"unknown rope scaling '{scaling}': use '', 'llama3' or 'yarn'")
    angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rope_tables(
    cfg: ModelConfig, head_dim: int, max_positions: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_frequencies`` with every scaling knob read from ``cfg``, for ``head_dim`` rotary dims
    (the attention head dim, or MLA's decoupled rope dim)."""
    return rope_frequencies(
        head_dim, max_positions, cfg.rotary_base, cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor, cfg.rope_original_max_position_embeddings, device, beta_fast=cfg.rope_beta_fast,
        beta_slow=cfg.rope_beta_slow, mscale=cfg.rope_mscale, mscale_all_dim=cfg.rope_mscale_all_dim,
    )  # fmt: skip


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Reorder the last dim from adjacent pairs (0,1), (2,3), ... to the two halves "rotate half"
    pairs: even dims, then odd ones.

    DeepSeek's checkpoints rotate adjacent pairs (HF: a complex product over ``view(..., -1, 2)``).
    Reordering q and k alike leaves their dot products unchanged, so applying ``apply_rotary``
    after this is that rotation; Megatron-Core's MLA does the same.
    """
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for stretching positions by ``factor``: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The cos/sin multiplier, as Hugging Face computes it: the ratio of the two temperatures when
    both are set (DeepSeek: 0.707 / 0.707, so 1), else the plain temperature of ``factor``."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_scaling(inv_freq: torch.Tensor, base: float, factor: float, original: int, beta_fast: float, beta_slow: float) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies (Peng et al. 2023).

    Dimensions that turn more than ``beta_fast`` times over the original context keep their
    frequency (extrapolated), those turning fewer than ``beta_slow`` times are divided by
    ``factor`` (interpolated), and a linear ramp over the dimension index blends the two between.
    The ramp ends are rounded outwards to whole dimensions, as in HF's default (``truncate``).
    """
    dim = 2 * inv_freq.shape[0]

    def dim_for_rotations(rotations: float) -> float:  # the dim index whose wavelength fits `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_for_rotations(beta_fast)), 0)
    high = min(math.ceil(dim_for_rotations(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, device=inv_freq.device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


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

