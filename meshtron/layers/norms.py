"""Normalization layers: LayerNorm (GPT) and RMSNorm (Llama).

Both normalize in fp32 whatever the activation dtype: the mean of squares of bf16 activations
loses too many bits to be trusted, and the cost of upcasting one row at a time is negligible.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """The norm named by ``model.normalization``.

    ``torch.nn.LayerNorm``'s kernels already accumulate in fp32 for half inputs and return the
    input dtype, so it is used as is.
    """
    if kind == "LayerNorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "RMSNorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown normalization '{kind}': use LayerNorm or RMSNorm")
