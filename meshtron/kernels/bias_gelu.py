"""The MLP's first bias and GELU in one pass each way: ``gelu(h + bias)`` on the bias-free output of
its first linear, fc1 (Megatron's ``--bias-gelu-fusion``; the exact erf GELU or the tanh
approximation, whichever the model uses).

Why: with the bias in fc1's GEMM (its epilogue adds it for free) the forward costs nothing more,
but the backward reads GELU's input gradient a second time, whole ([tokens, ffn]: the widest
activation of the block), only to sum it over the tokens into the bias gradient. Here the
backward kernel sums its own output as it writes it (fp32 partial sums per block of rows), so
that read is gone. The forward saves ``h`` and the bias, as GELU alone would save its input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.kernels import use_triton


def bias_gelu_reference(h: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(h + bias, approximate=approximate)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, tanh):
        from meshtron.kernels.triton_pointwise import bias_gelu_forward

        h2 = h.reshape(-1, h.shape[-1]).contiguous()
        ctx.save_for_backward(h2, bias)
        ctx.tanh, ctx.shape = tanh, h.shape
        return bias_gelu_forward(h2, bias, tanh).view(h.shape)

    @staticmethod
    def backward(ctx, grad_out):
        from meshtron.kernels.triton_pointwise import bias_gelu_backward

        h2, bias = ctx.saved_tensors
        grad_h, grad_bias = bias_gelu_backward(h2, bias, grad_out.reshape(h2.shape).contiguous(), ctx.tanh)
        return grad_h.view(ctx.shape), grad_bias, None


def bias_gelu(h: torch.Tensor, bias: torch.Tensor, approximate: str = "none", fused_kernels: str = "auto") -> torch.Tensor:
    """h [..., F] (fc1's output before its bias), bias [F] -> gelu(h + bias); ``approximate``: none | tanh."""
    if use_triton(fused_kernels, h):
        return _BiasGelu.apply(h, bias, approximate == "tanh")
    return bias_gelu_reference(h, bias, approximate)
