"""Normalization layers: LayerNorm (GPT) and RMSNorm (Llama).

Both normalize in fp32 whatever the activation dtype: the mean of squares of bf16 activations
loses too many bits to be trusted. The math (reference and fused kernel) lives in
``meshtron.kernels.norms``; these modules hold the parameters and pick the path.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.kernels.norms import layer_norm, rms_norm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, fused_kernels: str = "auto"):
        super().__init__()
        self.eps = eps
        self.fused_kernels = fused_kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.fused_kernels)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state dict) that runs the fused kernel where it pays."""

    def __init__(self, dim: int, eps: float = 1e-5, fused_kernels: str = "auto"):
        super().__init__(dim, eps=eps)
        self.fused_kernels = fused_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.fused_kernels)


def build_norm(kind: str, dim: int, eps: float, fused_kernels: str = "auto") -> nn.Module:
    """The norm named by ``model.normalization``."""
    if kind == "LayerNorm":
        return LayerNorm(dim, eps=eps, fused_kernels=fused_kernels)
    if kind == "RMSNorm":
        return RMSNorm(dim, eps=eps, fused_kernels=fused_kernels)
    raise ValueError(f"unknown normalization '{kind}': use LayerNorm or RMSNorm")
