"""Triton kernels for the dropless MoE permutation and combine, in gather form: no atomics.

``inverse`` [T, k] names the expert-input row holding token t's j-th copy (a permutation of the
T*k rows, from the dispatch plan's sort). One program per (token, column block) touches the
token's k rows as one [k, BLOCK] tile, so every element is written by exactly one program:
deterministic results, fp32 sums in registers, and each byte read or written once. A program per
column block rather than one walking the row: the gathers are latency-bound, and more programs
in flight hide more of that latency.

- permute forward: each token read once, written to its k rows (``scatter_copies``);
- permute backward and combine forward: a token's k rows gathered and summed, weighted or not,
  in fp32, rounded once to the output dtype (``gather_sum``);
- combine backward: the output gradient times each copy's weight written to that copy's row,
  and the weight's gradient as the dot product of output gradient and row (``combine_backward``).

The PyTorch reference is ``permute`` / ``unpermute`` in ``layers/moe/dispatch.py``. Imported only
when a kernel runs, so Triton stays optional.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token_rows(inverse_ptr, n_cols, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """This program's token ``t``, its copy slots (K padded to a power of two), which are real, the
    expert-input row of each copy, and its column block (``cols``, ``col_ok``)."""
    t = tl.program_id(0).to(tl.int64)
    copies = tl.arange(0, K_PAD)
    valid = copies < K
    row = tl.load(inverse_ptr + t * K + copies, mask=valid, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return t, copies, valid, row, cols, cols < n_cols


@triton.jit
def _scatter_copies_kernel(tokens_ptr, inverse_ptr, rows_ptr, n_cols, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """rows[inverse[t, j]] = tokens[t] for each of the k copies j."""
    t, copies, valid, row, cols, col_ok = _token_rows(inverse_ptr, n_cols, K, K_PAD, BLOCK)
    x = tl.load(tokens_ptr + t * n_cols + cols, mask=col_ok, other=0.0)
    tile = tl.broadcast_to(x[None, :], (K_PAD, BLOCK))
    tl.store(rows_ptr + row[:, None] * n_cols + cols[None, :], tile, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _gather_sum_kernel(
    rows_ptr, inverse_ptr, weights_ptr, out_ptr, n_cols,
    K: tl.constexpr, K_PAD: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[t] = sum_j w[t, j] * rows[inverse[t, j]] (w = 1 unless WEIGHTED), summed in fp32."""
    t, copies, valid, row, cols, col_ok = _token_rows(inverse_ptr, n_cols, K, K_PAD, BLOCK)
    if WEIGHTED:
        w = tl.load(weights_ptr + t * K + copies, mask=valid, other=0.0).to(tl.float32)
    else:
        w = tl.where(valid, 1.0, 0.0)
    tile = tl.load(rows_ptr + row[:, None] * n_cols + cols[None, :], mask=valid[:, None] & col_ok[None, :], other=0.0)
    total = tl.sum(tile.to(tl.float32) * w[:, None], axis=0)
    tl.store(out_ptr + t * n_cols + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _combine_backward_kernel(
    grad_ptr, rows_ptr, inverse_ptr, weights_ptr, grad_rows_ptr, partial_dots_ptr, n_cols,
    K: tl.constexpr, K_PAD: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """grad_rows[inverse[t, j]] = w[t, j] * g[t]; this column block's part of <g[t], rows[inverse[t, j]]>
    (fp32, [T, blocks, K]: the caller sums the blocks)."""
    t, copies, valid, row, cols, col_ok = _token_rows(inverse_ptr, n_cols, K, K_PAD, BLOCK)
    w = tl.load(weights_ptr + t * K + copies, mask=valid, other=0.0).to(tl.float32)
    mask = valid[:, None] & col_ok[None, :]
    g = tl.load(grad_ptr + t * n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
    at_rows = row[:, None] * n_cols + cols[None, :]
    tl.store(grad_rows_ptr + at_rows, (w[:, None] * g[None, :]).to(grad_rows_ptr.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        tile = tl.load(rows_ptr + at_rows, mask=mask, other=0.0).to(tl.float32)
        part = (t * tl.num_programs(1) + tl.program_id(1)) * K
        tl.store(partial_dots_ptr + part + copies, tl.sum(tile * g[None, :], axis=1), mask=valid)


def _launch(n_cols: int, topk: int, num_tokens: int) -> tuple[tuple[int, int], dict]:
    """Grid (token, column block) and meta: the block, the copy count padded to a power of two, at
    least 2 wide (no 1-wide tile dimension)."""
    block = min(512, triton.next_power_of_2(max(n_cols, 16)))
    return (num_tokens, triton.cdiv(n_cols, block)), dict(K=topk, K_PAD=max(2, triton.next_power_of_2(topk)), BLOCK=block, num_warps=4)


def scatter_copies(tokens: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """tokens [T, h] contiguous, inverse [T, k] -> rows [T*k, h]."""
    (num_tokens, topk), n_cols = inverse.shape, tokens.shape[1]
    rows = torch.empty(num_tokens * topk, n_cols, dtype=tokens.dtype, device=tokens.device)
    if rows.numel():
        grid, meta = _launch(n_cols, topk, num_tokens)
        _scatter_copies_kernel[grid](tokens, inverse, rows, n_cols, **meta)
    return rows


def gather_sum(rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """rows [T*k, h] contiguous, inverse [T, k], weights [T, k] or None -> [T, h] in ``out_dtype``."""
    (num_tokens, topk), n_cols = inverse.shape, rows.shape[1]
    out = torch.empty(num_tokens, n_cols, dtype=out_dtype, device=rows.device)
    if out.numel():
        placeholder = inverse  # an unused pointer when unweighted
        grid, meta = _launch(n_cols, topk, num_tokens)
        _gather_sum_kernel[grid](rows, inverse, placeholder if weights is None else weights, out, n_cols,
                                 WEIGHTED=weights is not None, **meta)  # fmt: skip
    return out


def combine_backward(
    grad: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """grad [T, h], rows [T*k, h], inverse and weights [T, k], all contiguous -> (grad_rows [T*k, h]
    in the rows' dtype, grad_weights [T, k] in the weights' dtype, or None without ``weight_grad``)."""
    (num_tokens, topk), n_cols = inverse.shape, rows.shape[1]
    grad_rows = torch.empty_like(rows)
    grid, meta = _launch(n_cols, topk, num_tokens)
    partial_dots = torch.zeros(num_tokens, grid[1], topk, dtype=torch.float32, device=rows.device) if weight_grad else None
    if grad_rows.numel():
        _combine_backward_kernel[grid](
            grad, rows, inverse, weights, grad_rows, partial_dots if weight_grad else weights, n_cols,
            WEIGHT_GRAD=weight_grad, **meta,
        )  # fmt: skip
    grad_weights = partial_dots.sum(1).to(weights.dtype) if weight_grad else None
    return grad_rows, grad_weights


class PermuteCopies(torch.autograd.Function):
    """tokens [T, h] -> rows [T*k, h], row ``inverse[t, j]`` a copy of token t; the backward sums
    each token's k row gradients (fp32, in the tokens' dtype)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.dtype = tokens.dtype
        return scatter_copies(tokens.contiguous(), inverse.contiguous())

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return gather_sum(grad_rows.contiguous(), inverse.contiguous(), None, ctx.dtype), None


class CombineCopies(torch.autograd.Function):
    """rows [T*k, h], weights [T, k] -> [T, h] in ``out_dtype``: each token's copies weighted and
    summed in fp32."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        rows, weights, inverse = rows.contiguous(), weights.contiguous(), inverse.contiguous()
        ctx.save_for_backward(rows, weights, inverse)
        return gather_sum(rows, inverse, weights, out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weights, inverse = ctx.saved_tensors
        grad_rows, grad_weights = combine_backward(grad.contiguous(), rows, inverse, weights, ctx.needs_input_grad[1])
        return grad_rows, grad_weights, None, None


# Run eagerly inside a compiled block (a graph break), as the grouped GEMM's kernels do.
@torch.compiler.disable
def permute_copies(tokens: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return PermuteCopies.apply(tokens, inverse)


@torch.compiler.disable
def combine_copies(rows: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return CombineCopies.apply(rows, weights, inverse, out_dtype)
