"""The fp32 router gate (``--moe-router-dtype fp32``) of bf16 tokens and weights, its backward on
bf16 tensor cores.

Megatron's fp32 router casts the tokens and the gate weight to fp32 and multiplies in fp32; autograd
keeps the fp32 copy of the tokens ([tokens, hidden], twice the activation) and the backward runs
two more fp32 GEMMs and casts back: SIMT-speed GEMMs for a [tokens, 64] product, ~0.3 ms a
DeepSeek-V2-Lite layer at 8192 tokens on an H100. Here:

- forward: the same fp32 GEMM of the cast values, whose copies are freed at once (the bf16 tokens
  are kept instead). Tensor cores would do it from the bf16 values, but their fp32 accumulation
  truncates: 2.1e-6 relative error in the logits against the fp32 GEMM's 1.7e-7, and the router
  runs in fp32 for its logits' precision;
- backward: the fp32 gradient g [T, E] is split into three bf16 pieces, g = hi + mid + lo to
  fp32's 24 bits (each piece holds the next 8), and each product is one bf16 GEMM over the pieces
  side by side (K = 3E) accumulating in fp32: dx = [hi|mid|lo] @ [W;W;W] and dW = [hi|mid|lo]^T @ x
  (its three row blocks summed), each rounded once to bf16 as the fp32 path rounds them. The
  accumulation's error stays far below that rounding: against fp64, both paths' dx and dW differ
  in the sixth significant digit of their (bf16-sized) errors.

Where Triton runs (``model.fused_kernels``) the split is one kernel (``triton_pointwise.split_in_three``)
rather than eight PyTorch ops. ``mm(..., out_dtype=float32)`` is CUDA-only; elsewhere the same products run in fp32 (exact
emulation), so the CPU tests hold the split to the plain fp32 path.
"""

from __future__ import annotations

import torch

from meshtron.kernels import use_triton


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` of bf16 operands accumulated in fp32, returned in ``out_dtype``."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype)
    return torch.mm(a.float(), b.float()).to(out_dtype)


def split_in_three(g: torch.Tensor) -> torch.Tensor:
    """fp32 [T, E] -> bf16 [T, 3E] = [hi | mid | lo] with hi + mid + lo == g to fp32's precision."""
    hi = g.to(torch.bfloat16)
    rest = g - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.cat((hi, mid, lo), dim=1)


class Fp32Gate(torch.autograd.Function):
    """x [T, h] bf16, weight [E, h] bf16 -> fp32 logits [T, E] (the fp32 path's); gradients as its."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, fused_kernels: str = "off") -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.fused_kernels = fused_kernels
        return torch.nn.functional.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        if use_triton(ctx.fused_kernels, grad):
            from meshtron.kernels import triton_pointwise  # Triton stays optional

            pieces = triton_pointwise.split_in_three(grad.float().contiguous())
        else:
            pieces = split_in_three(grad.float())
        dx = _mm(pieces, weight.repeat(3, 1), x.dtype) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = _mm(pieces.t(), x, torch.float32).view(3, *weight.shape).sum(0).to(weight.dtype)
        return dx, dw, None


def fp32_gate(x: torch.Tensor, weight: torch.Tensor, fused_kernels: str = "off") -> torch.Tensor:
    """fp32 logits of ``x @ weight^T``: through ``Fp32Gate`` for bf16 operands (outside compiled
    code, where the plain path is traced), else by casting both to fp32."""
    if x.dtype == weight.dtype == torch.bfloat16 and x.dim() == 2 and not torch.compiler.is_compiling():
        return Fp32Gate.apply(x, weight, fused_kernels)
    return torch.nn.functional.linear(x.float(), weight.float())
