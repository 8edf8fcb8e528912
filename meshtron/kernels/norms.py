"""RMSNorm and LayerNorm: fp32 references and their fused kernels behind one autograd Function.

The references normalize in fp32 whatever the activation dtype (the mean of squares of bf16
activations loses too many bits). Unfused, autograd saves the fp32 upcast of every normalized
activation and several fp32 intermediates; the kernels save the input in its own dtype plus one
or two fp32 numbers per row, and read and write each row once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.kernels import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.layer_norm`` already accumulates in fp32 for half inputs and returns the input dtype."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class _Norm(torch.autograd.Function):
    """RMSNorm when ``bias`` is None, else LayerNorm; x [..., cols]."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        from meshtron.kernels.triton_norms import norm_forward

        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y, mean, rstd = norm_forward(x2, weight, bias, eps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.rms, ctx.shape = bias is None, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        from meshtron.kernels.triton_norms import norm_backward

        x2, weight, mean, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).contiguous()
        dx, dw, db = norm_backward(x2, weight, mean, rstd, dy2, ctx.rms)
        return dx.view(ctx.shape), dw, db, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused_kernels: str = "auto") -> torch.Tensor:
    if use_triton(fused_kernels, x):
        return _Norm.apply(x, weight, None, eps)
    return rms_norm_reference(x, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, fused_kernels: str = "auto"
) -> torch.Tensor:
    if use_triton(fused_kernels, x):
        return _Norm.apply(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)
