"""A residual branch's dropout and the residual add in one pass: ``residual + dropout(x, p)``
(Megatron's bias-dropout-add, ``--bias-dropout-fusion``; the branch's bias stays in its linear,
whose GEMM epilogue adds it without a pass of its own).

Unfused, the forward is two kernels (dropout writes its output and a byte mask, the add reads
that output back) and the backward reads the mask again. The kernel draws each element's keep
decision from Philox (``tl.rand4x``: one call gives four elements their uniforms, as curand's
4x32-10 does for ``F.dropout``) keyed by a seed and the elements' index, so no mask is stored: the forward reads x and the residual and writes the sum; the backward recomputes the
mask, reads the gradient and writes x's (the residual's gradient is the incoming one itself).

The seed is a one-element tensor drawn from the device's default generator when the op runs (no
host sync), so ``torch.manual_seed`` makes the masks reproducible, and activation recompute,
which restores the RNG state, draws the same seed and so the same masks. The draws are not
``F.dropout``'s: the fused and the reference path agree in distribution, not element by element
(exactly when nothing is dropped: p = 0 or evaluation, where both are the plain add).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.kernels import use_triton


def dropout_add_reference(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """The unfused op, as the blocks wrote it: ``residual + F.dropout(x, p, training)``."""
    return residual + F.dropout(x, p, training)


def draw_seed(device: torch.device) -> torch.Tensor:
    """A fresh mask seed [1] (int64) from ``device``'s default generator, without a host sync."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


class _DropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, p):
        from meshtron.kernels.triton_pointwise import dropout_add_forward

        seed = draw_seed(x.device)
        out = dropout_add_forward(x.contiguous(), residual.contiguous(), seed, p, torch.promote_types(x.dtype, residual.dtype))
        ctx.save_for_backward(seed)
        ctx.p, ctx.x_dtype, ctx.residual_dtype = p, x.dtype, residual.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        from meshtron.kernels.triton_pointwise import dropout_backward

        (seed,) = ctx.saved_tensors
        grad_x = dropout_backward(grad.contiguous(), seed, ctx.p, ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return grad_x, grad.to(ctx.residual_dtype), None


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool, fused_kernels: str = "auto") -> torch.Tensor:
    """``residual + dropout(x, p)`` (dropout only in ``training``); x and residual of one shape.
    The Triton kernel where ``use_triton`` says so and something is dropped, else the reference
    (also inside a compiled block: inductor fuses the two ops itself, masks drawn its own way)."""
    if not training or p == 0.0:
        return residual + x
    if p < 1.0 and x.shape == residual.shape and use_triton(fused_kernels, x) and not torch.compiler.is_compiling():
        return _DropoutAdd.apply(x, residual, p)
    return dropout_add_reference(x, residual, p, training)
