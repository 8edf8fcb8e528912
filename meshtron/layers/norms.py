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


class HeadSum(nn.Module):
    """Per-token sums over the attention heads a module sees -> over all heads: the same in one
    process. Under tensor parallelism a rank holds some of the heads, and the parallel plan
    replaces this module by a sum over the tp ranks (``SumOverHeadShards`` style)."""

    def forward(self, partial_sums: torch.Tensor) -> torch.Tensor:
        return partial_sums


class FullWidthRMSNorm(nn.Module):
    """RMSNorm over a whole projection's output, every head's q (or k) at once (OLMoE's q/k norms),
    where ``--qk-layernorm``'s default norms each head alone: x / sqrt(mean over ``width``(x^2) + eps)
    * weight, in fp32. Under tensor parallelism a rank holds its heads' columns of x and of the
    weight; ``head_sum`` completes the sum of squares over the other ranks' heads, and the mean
    divides by the whole ``width``. No fused kernel: the reference's arithmetic in torch ops."""

    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.width, self.eps = width, eps
        self.weight = nn.Parameter(torch.ones(width))
        self.head_sum = HeadSum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        sum_of_squares = self.head_sum(x32.square().sum(-1, keepdim=True))
        normed = x32 * torch.rsqrt(sum_of_squares / self.width + self.eps)
        return (normed * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.width}, eps={self.eps}"


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
