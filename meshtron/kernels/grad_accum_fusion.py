"""Gradient-accumulation fusion (Megatron's ``--gradient-accumulation-fusion``): a linear layer's
weight gradient is computed straight into the fp32 ``param.main_grad`` of the gradient buffer.

Why: without it autograd materializes a bf16 weight gradient, and the buffer's hook reads it back
and adds it into ``main_grad`` (``meshtron.optim.grad_buffer.GradBuffer``). Here the wgrad
GEMM accumulates in fp32 into the buffer itself (beta = 1), so neither the bf16 tensor nor the
separate add exists, and the sum is not rounded to bf16 first.

On a GPU that is one cuBLAS call, ``addmm`` with ``out_dtype=float32`` and ``out=main_grad``,
where this torch build takes an fp32 accumulator with bf16/fp16 operands (probed once); where it
does not, the bf16 product is added as the hook would. On the CPU (no such overload) the operands
are upcast and ``addmm_`` accumulates in fp32, so the flag is testable there.

The fused function hands no weight gradient back to autograd; its backward tells the buffer the
gradient is in (``GradBuffer.fused_grad_ready``), which launches the bucket's collective exactly
as the hook would have. Each fused function keeps the parameter object itself on its context
(``ctx.param``), not only among its saved tensors: an activation checkpoint's recompute hands
saved tensors back detached, and a detached weight has no ``main_grad`` or ``grad_buffer``.
Layers whose weight has no ``main_grad`` (FSDP, evaluation, a model with no
optimizer) use the ordinary path. FP8 linears fuse in their own backward (``fp8.linear``'s
``into_main_grad``: the FP8 GEMM's fp32 output written into ``main_grad``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.kernels import deferred_wgrad
from meshtron.kernels.fp8 import linear as fp8_linear
from meshtron.kernels.fp8 import takes_main_grad
from meshtron.kernels.fp8_scaling import Fp8Scaling
from meshtron.kernels.linear_swap import replace_linears, with_parameters_of


@functools.cache
def _fp32_addmm_in_place(device_index: int) -> bool:
    """Whether this build's CUDA ``addmm`` accumulates bf16 operands into an fp32 ``out`` given as
    its own input (older releases insist the input share the operands' dtype)."""
    acc = torch.ones(2, 2, device=torch.device("cuda", device_index))
    ones = torch.ones(2, 3, device=acc.device, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, ones, ones.t(), out_dtype=torch.float32, out=acc)
    except RuntimeError:
        return False
    return bool((acc == 4.0).all())


def accumulate_wgrad(main_grad: torch.Tensor, grad_2d: torch.Tensor, x_2d: torch.Tensor, overwrite: bool = False) -> None:
    """``main_grad += grad_2d^T @ x_2d`` ([out, tokens] @ [tokens, in]), accumulating in ``main_grad``'s
    dtype; ``overwrite``: ``main_grad = ...`` (its first gradient of the step: beta 0, nothing read)."""
    beta = 0.0 if overwrite else 1.0
    if grad_2d.dtype == main_grad.dtype:
        main_grad.addmm_(grad_2d.t(), x_2d, beta=beta)
    elif main_grad.is_cuda and _fp32_addmm_in_place(main_grad.device.index):
        torch.addmm(main_grad, grad_2d.t(), x_2d, beta=beta, out_dtype=main_grad.dtype, out=main_grad)
    elif main_grad.is_cuda and overwrite:
        main_grad.copy_(grad_2d.t() @ x_2d)
    elif main_grad.is_cuda:
        main_grad.add_(grad_2d.t() @ x_2d)
    else:
        main_grad.addmm_(grad_2d.t().to(main_grad.dtype), x_2d.to(main_grad.dtype), beta=beta)


def accumulate_wgrad_of(weight: torch.Tensor, grad_2d: torch.Tensor, x_2d: torch.Tensor) -> None:
    """``weight``'s gradient ``grad_2d^T @ x_2d`` into its ``main_grad`` (written if it is the step's
    first, else added), then reported to its buffer as landed; inside a zero-bubble schedule's
    input-gradient pass, kept for its weight-gradient pass instead (``deferred_wgrad``)."""
    deferred_wgrad.defer_or_run(weight, lambda overwrite: accumulate_wgrad(weight.main_grad, grad_2d, x_2d, overwrite))


def accumulate_scaled_of(weight: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor, kernel: bool) -> None:
    """``weight``'s gradient ``grad * scale`` (``scale`` a 0-d fp32 tensor) into its ``main_grad`` in
    fp32 (written if it is the step's first, else added), then reported to its buffer as landed:
    one pass (``kernel``: the Triton kernel) where a scale in place and the buffer's copy were two."""
    buffer, main_grad = weight.grad_buffer, weight.main_grad
    overwrite = buffer.take_first_write(weight)
    if kernel:
        from meshtron.kernels.triton_pointwise import scale_into

        scale_into(main_grad, grad, scale, accumulate=not overwrite)
    elif overwrite:
        main_grad.copy_(grad).mul_(scale)
    else:
        main_grad.addcmul_(grad, scale)
    buffer.fused_grad_ready(weight)


class _LinearIntoMainGrad(torch.autograd.Function):
    """y = x W^T + b whose backward accumulates W's gradient into ``W.main_grad``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.has_bias = weight, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        accumulate_wgrad_of(ctx.param, grad_2d, x.reshape(-1, x.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: Fp8Scaling | None = None,
           fuse: bool = False) -> torch.Tensor:  # fmt: skip
    """``fp8.linear`` (``F.linear`` unless ``fp8`` scaling is given), with the weight gradient fused into
    ``weight.main_grad`` when ``fuse`` is set and the weight has one and will get a gradient."""
    fused = takes_main_grad(weight, fuse)
    if fused and fp8 is None:
        return _LinearIntoMainGrad.apply(x, weight, bias)
    return fp8_linear(x, weight, bias, fp8, into_main_grad=fused)


class FusedWgradLinear(nn.Linear):
    """An ``nn.Linear`` whose weight gradient goes straight into ``main_grad``; put in each plain
    linear's place by ``apply_gradient_accumulation_fusion`` (same parameters, names and state dict).
    ``skip_bias_add``: the bias is left to the caller (``layers/mlp.enable_bias_gelu_fusion``)."""

    skip_bias_add = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None if self.skip_bias_add else self.bias, fuse=True)


def apply_gradient_accumulation_fusion(blocks: nn.Module, heads: list[nn.Module] = ()) -> None:
    """Fuse the weight gradients of the linears under ``blocks`` (the transformer blocks): plain
    ``nn.Linear`` are replaced by ``FusedWgradLinear`` (same parameters), the tensor-parallel linears and the MoE experts get
    ``grad_accum_fusion = True``; so do ``heads`` (output layers, whose loss has a fused path of its
    own). An output layer whose weight is tied to the embedding keeps the ordinary path at call
    time, as autograd must add the two gradients of that one weight."""
    replace_linears(blocks, lambda linear: with_parameters_of(FusedWgradLinear, linear))
    for module in blocks.modules():
        if hasattr(module, "grad_accum_fusion"):
            module.grad_accum_fusion = True
    for head in heads:
        head.grad_accum_fusion = True
