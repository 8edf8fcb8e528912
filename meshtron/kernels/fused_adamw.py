"""One-pass AdamW over flat buffers: unscale and clip the gradient, update the fp32 master and
both moments, write the model's low-precision copy; and the gradient norm's sum of squares over
the same buffers, one pass.

Why: the reference step (``MixedPrecisionOptimizer`` with ``--optimizer-impl reference``) multiplies
every gradient by the clip coefficient, runs ``torch.optim.AdamW`` and copies the masters into
the model, three passes over memory; this reads the gradient, master and moments once and
writes master, moments and model copy once (about 31 bytes per parameter instead of about 45).

The clip coefficient (already divided by the loss scale) is a 0-d device tensor, so nothing
waits for the host. Weight decay differs per parameter group: each element carries its group's
index (0 or 1, ``uint8``) and the kernel picks that group's ``1 - lr * weight_decay``, a scalar. The arithmetic
follows ``torch.optim.AdamW``'s step operation by operation, in fp32, so the two agree to
rounding.

Triton is imported only here; ``MixedPrecisionOptimizer`` keeps the reference path for the CPU
and wherever Triton is missing.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_BLOCK = 4096
_MIXED = 2  # block_groups' mark of a block whose elements belong to both parameter groups
MIXED = tl.constexpr(_MIXED)


@triton.jit
def _adamw_kernel(
    grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, model_ptr, group_ptr, coef_ptr,
    block_group_ptr, n, decay0, decay1, beta1, beta2, eps, step_size, bias_correction2_sqrt,
    WRITE_MODEL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    coef = tl.load(coef_ptr)
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * coef
    master = tl.load(master_ptr + offs, mask=mask, other=0.0)
    exp_avg = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # stored fp32, or bf16/fp16 (precision-aware)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    block_group = tl.load(block_group_ptr + pid)  # the block's group, or MIXED: read each element's
    mixed = tl.full((BLOCK,), 0, tl.int32) + block_group.to(tl.int32) == MIXED
    element_group = tl.load(group_ptr + offs, mask=mask & mixed, other=0)
    decay = tl.where(tl.where(mixed, element_group, block_group) == 0, decay0, decay1)
    master = master * decay
    exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)  # torch.lerp's form for a weight below 0.5
    exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * (grad * grad)
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    master = master + step_size * (exp_avg / denom)
    tl.store(master_ptr + offs, master, mask=mask)
    tl.store(exp_avg_ptr + offs, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    if WRITE_MODEL:
        tl.store(model_ptr + offs, master.to(model_ptr.dtype.element_ty), mask=mask)


def fused_adamw(
    grad: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    model: torch.Tensor | None,
    group_index: torch.Tensor,
    block_group: torch.Tensor,
    *,
    coef: torch.Tensor,
    decay: list[float],
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """One AdamW step (``step`` counted from 1) over equal-length flat tensors, in place.

    ``grad`` (fp32 or low precision) is multiplied by the 0-d ``coef`` first; ``master`` is fp32,
    the moments fp32 or (precision-aware) bf16/fp16, read into fp32 and rounded back when stored; ``model`` receives the master rounded to its dtype (None: ``master`` is the
    model's own fp32 parameter); ``group_index`` (uint8, 0 or 1) picks each element's entry of
    ``decay``, its group's ``1 - lr * weight_decay``; ``block_group`` is ``block_groups(group_index)``,
    so only blocks that straddle a group boundary read it. Scalars are formed on the host in double, as
    ``torch.optim.AdamW`` forms them, then rounded to fp32 once.
    """
    n = master.numel()
    if n == 0:
        return
    beta1, beta2 = betas
    decay0, decay1 = (decay + decay)[:2]  # one group: both entries its own
    step_size = -lr / (1 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        grad, master, exp_avg, exp_avg_sq, master if model is None else model, group_index, coef,
        block_group, n, decay0, decay1, beta1, beta2, eps, step_size, bias_correction2_sqrt,
        WRITE_MODEL=model is not None, BLOCK=_BLOCK, num_warps=8,
    )  # fmt: skip


def block_groups(group_index: torch.Tensor) -> torch.Tensor:
    """[blocks of the kernel] uint8: the parameter group of every element of the block, or 2 where
    the block holds both. Parameters span many blocks, so nearly every block reads one byte
    instead of 4096: the per-element index would be a thirtieth of the step's memory traffic."""
    n = group_index.numel()
    full = n // _BLOCK * _BLOCK
    pieces = [group_index[:full].view(-1, _BLOCK)] + ([group_index[full:].view(1, -1)] if full < n else [])
    low = torch.cat([p.amin(dim=1) for p in pieces])
    high = torch.cat([p.amax(dim=1) for p in pieces])
    return torch.where(low == high, low, torch.full_like(low, _MIXED))


@triton.jit
def _sum_squares_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(x * x, 0))


def sum_of_squares(flats: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 sum of squares of every element of the flat ``flats``, as a 0-d tensor: the step's
    gradient norm in one pass at memory bandwidth (per-block partial sums, then their sum: no
    atomics, so the same gradients give the same norm)."""
    partials = []
    for x in flats:
        blocks = triton.cdiv(x.numel(), _BLOCK)
        partials.append(torch.empty(blocks, dtype=torch.float32, device=x.device))
        if blocks:
            _sum_squares_kernel[(blocks,)](x, partials[-1], x.numel(), BLOCK=_BLOCK, num_warps=8)
    return torch.cat(partials).sum()
