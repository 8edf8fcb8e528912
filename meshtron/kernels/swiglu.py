"""SwiGLU activation, silu(gate) * up, on the fused [gate | up] output of the MLP's first projection.

Unfused, autograd keeps silu(gate) as well as gate and up: one extra [tokens, ffn] tensor per
layer. The kernel keeps only its input and recomputes the sigmoid in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.kernels import use_triton


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        from meshtron.kernels.triton_pointwise import swiglu_forward

        h2 = h.reshape(-1, h.shape[-1]).contiguous()
        ctx.save_for_backward(h2)
        ctx.shape = h.shape
        return swiglu_forward(h2).view(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    def backward(ctx, grad_out):
        from meshtron.kernels.triton_pointwise import swiglu_backward

        (h2,) = ctx.saved_tensors
        grad = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        return swiglu_backward(h2, grad).view(ctx.shape)


def swiglu(h: torch.Tensor, fused_kernels: str = "auto") -> torch.Tensor:
    """h [..., 2F] (gate first) -> [..., F]."""
    return _SwiGLU.apply(h) if use_triton(fused_kernels, h) else swiglu_reference(h)
