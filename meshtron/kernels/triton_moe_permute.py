"""Triton kernels for the dropless MoE permutation and combine, in gather form: no atomics.

``inverse`` [T, k] names the expert-input row holding token t's j-th copy (a permutation of the
T*k rows, from the dispatch plan's sort). One program per token walks the hidden dimension in
column blocks and touches its k rows (as one [k, BLOCK] tile, or row by row where it sums them),
so every row is written by exactly one program: deterministic results, fp32 sums in registers,
and each byte read or written once.

- permute forward: each token read once, written to its k rows (``scatter_copies``);
- permute backward and combine forward: a token's k rows gathered and summed, weighted or not,
  in fp32, one row at a time, rounded once to the output dtype (``gather_sum``);
- combine backward: the output gradient times each copy's weight written to that copy's row,
  and the weight's gradient as the dot product of output gradient and row (``combine_backward``).

``inverse`` itself comes from three more kernels (``plan_rows``): the copies in blocks, each block's
copies per expert and each copy's rank among its block's copies of the same expert; a scan down
the blocks per expert (the copies of that expert in earlier blocks, and its total); then each
copy's row = its expert's first row + the copies of that expert in earlier blocks + its rank. That
is the stable sort by expert of the reference (``_sort_by_expert``), bit for bit, in three launches
rather than a dozen PyTorch ops, with work linear in the copies.

The PyTorch reference is ``plan_dispatch`` / ``permute`` / ``unpermute`` in ``layers/moe/dispatch.py``.
Imported only when a kernel runs, so Triton stays optional.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token_rows(inverse_ptr, K: tl.constexpr, K_PAD: tl.constexpr):
    """This program's token ``t``, its copy slots (K padded to a power of two), which are real, and
    the expert-input row of each copy."""
    t = tl.program_id(0).to(tl.int64)
    copies = tl.arange(0, K_PAD)
    valid = copies < K
    row = tl.load(inverse_ptr + t * K + copies, mask=valid, other=0).to(tl.int64)
    return t, copies, valid, row


@triton.jit
def _scatter_copies_kernel(tokens_ptr, inverse_ptr, rows_ptr, n_cols, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """rows[inverse[t, j]] = tokens[t] for each of the k copies j."""
    t, copies, valid, row = _token_rows(inverse_ptr, K, K_PAD)
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(tokens_ptr + t * n_cols + cols, mask=cols < n_cols, other=0.0)
        tile = tl.broadcast_to(x[None, :], (K_PAD, BLOCK))
        tl.store(rows_ptr + row[:, None] * n_cols + cols[None, :], tile, mask=valid[:, None] & (cols[None, :] < n_cols))


@triton.jit
def _gather_sum_kernel(
    rows_ptr, inverse_ptr, weights_ptr, out_ptr, n_cols,
    K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[t] = sum_j w[t, j] * rows[inverse[t, j]] (w = 1 unless WEIGHTED), summed in fp32.

    The k copies are added one row at a time into a [BLOCK] accumulator that each thread holds
    its part of: no reduction across threads (a [k, BLOCK] tile summed over its rows needed one
    per column block)."""
    t = tl.program_id(0).to(tl.int64)
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        col_ok = cols < n_cols
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inverse_ptr + t * K + j).to(tl.int64)
            x = tl.load(rows_ptr + row * n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
            if WEIGHTED:
                x = x * tl.load(weights_ptr + t * K + j).to(tl.float32)
            total += x
        tl.store(out_ptr + t * n_cols + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _combine_backward_kernel(
    grad_ptr, rows_ptr, inverse_ptr, weights_ptr, grad_rows_ptr, grad_weights_ptr, n_cols,
    K: tl.constexpr, K_PAD: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """grad_rows[inverse[t, j]] = w[t, j] * g[t]; grad_w[t, j] = <g[t], rows[inverse[t, j]]> (fp32)."""
    t, copies, valid, row = _token_rows(inverse_ptr, K, K_PAD)
    w = tl.load(weights_ptr + t * K + copies, mask=valid, other=0.0).to(tl.float32)
    products = tl.zeros((K_PAD, BLOCK), dtype=tl.float32)  # summed over columns once, after the loop
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = valid[:, None] & (cols[None, :] < n_cols)
        g = tl.load(grad_ptr + t * n_cols + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        at_rows = row[:, None] * n_cols + cols[None, :]
        tl.store(grad_rows_ptr + at_rows, (w[:, None] * g[None, :]).to(grad_rows_ptr.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            products += tl.load(rows_ptr + at_rows, mask=mask, other=0.0).to(tl.float32) * g[None, :]
    if WEIGHT_GRAD:
        dots = tl.sum(products, axis=1)
        tl.store(grad_weights_ptr + t * K + copies, dots.to(grad_weights_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _block_ranks_kernel(experts_ptr, work_ptr, N, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Copies [pid * BLOCK, +BLOCK): each one's rank among the block's copies of its expert (at
    ``work[copy]``) and the block's copies per expert (at ``work[N + pid * E + e]``)."""
    pid = tl.program_id(0)
    copy = pid * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_E)
    ok = copy < N
    expert = tl.load(experts_ptr + copy, mask=ok, other=0)
    one_hot = (expert[:, None] == cols[None, :]) & ok[:, None]
    ones = one_hot.to(tl.int32)
    rank = tl.sum(tl.where(one_hot, tl.cumsum(ones, 0) - 1, 0), 1)
    tl.store(work_ptr + copy, rank, mask=ok)
    tl.store(work_ptr + N + pid * E + cols, tl.sum(ones, 0), mask=cols < E)


@triton.jit
def _block_prefix_kernel(work_ptr, totals_ptr, N, E, blocks, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """For experts [pid * BLOCK_C, +BLOCK_C): the blocks' counts (``work[N + b * E + e]``) replaced in
    place by the copies of that expert in earlier blocks, and the expert's total (``totals[e]``). One
    pass down the blocks per program, so the work is linear in the blocks."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < E
    carry = tl.zeros((BLOCK_C,), dtype=tl.int32)
    for first in range(0, blocks, BLOCK_B):
        block = first + tl.arange(0, BLOCK_B)
        where = work_ptr + N + block[:, None] * E + cols[None, :]
        mask = (block < blocks)[:, None] & col_ok[None, :]
        counts = tl.load(where, mask=mask, other=0)
        tl.store(where, carry[None, :] + tl.cumsum(counts, 0) - counts, mask=mask)
        carry += tl.sum(counts, 0)
    tl.store(totals_ptr + cols, carry, mask=col_ok)


@triton.jit
def _block_rows_kernel(
    experts_ptr, work_ptr, totals_ptr, inverse_ptr, counts_ptr, N, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Each copy's row in the expert-grouped order: its expert's first row + that expert's copies in
    earlier blocks (``_block_prefix_kernel``) + its rank; the first program also writes the copies per
    expert [E]."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    total = tl.load(totals_ptr + cols, mask=col_ok, other=0)
    offset = tl.cumsum(total, 0) - total + tl.load(work_ptr + N + pid * E + cols, mask=col_ok, other=0)
    copy = pid * BLOCK + tl.arange(0, BLOCK)
    ok = copy < N
    expert = tl.load(experts_ptr + copy, mask=ok, other=0)
    row = tl.sum(tl.where(expert[:, None] == cols[None, :], offset[None, :], 0), 1) + tl.load(work_ptr + copy, mask=ok, other=0)
    tl.store(inverse_ptr + copy, row.to(tl.int64), mask=ok)
    if pid == 0:
        tl.store(counts_ptr + cols, total.to(tl.int64), mask=col_ok)


PLAN_MAX_EXPERTS = 512  # a block's [copies, experts] one-hot stays within a program's registers


@torch.compiler.disable  # run eagerly inside a compiled block, as the permutation's kernels
def plan_rows(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert ids [T, k] (each below ``num_experts`` <= ``PLAN_MAX_EXPERTS``) -> (copies per
    expert [E] int64, ``inverse`` [T, k] int64: the row of each copy when the copies are sorted
    by expert, stable)."""
    n = experts.numel()
    block_e = triton.next_power_of_2(num_experts)
    block = max(16, min(128, 8192 // block_e))  # a [block, E] int32 scan: 32 KiB of shared memory at most
    blocks = triton.cdiv(n, block)
    counts = torch.empty(num_experts, dtype=torch.int64, device=experts.device)
    inverse = torch.empty(experts.shape, dtype=torch.int64, device=experts.device)
    if n == 0:
        return counts.zero_(), inverse
    work = torch.empty(n + blocks * num_experts, dtype=torch.int32, device=experts.device)
    totals = torch.empty(num_experts, dtype=torch.int32, device=experts.device)
    experts = experts.contiguous()
    _block_ranks_kernel[(blocks,)](experts, work, n, num_experts, BLOCK=block, BLOCK_E=block_e)
    columns = min(block_e, 64)
    _block_prefix_kernel[(triton.cdiv(num_experts, columns),)](work, totals, n, num_experts, blocks, BLOCK_B=64, BLOCK_C=columns)
    _block_rows_kernel[(blocks,)](experts, work, totals, inverse, counts, n, num_experts, BLOCK=block, BLOCK_E=block_e)
    return counts, inverse


def _meta(n_cols: int, topk: int) -> dict:
    """Column block and padded copy count; at least 2 copies wide (no 1-wide tile dimension)."""
    return dict(K=topk, K_PAD=max(2, triton.next_power_of_2(topk)), BLOCK=min(512, triton.next_power_of_2(max(n_cols, 16))), num_warps=4)


def scatter_copies(tokens: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """tokens [T, h] contiguous, inverse [T, k] -> rows [T*k, h]."""
    (num_tokens, topk), n_cols = inverse.shape, tokens.shape[1]
    rows = torch.empty(num_tokens * topk, n_cols, dtype=tokens.dtype, device=tokens.device)
    if rows.numel():
        _scatter_copies_kernel[(num_tokens,)](tokens, inverse, rows, n_cols, **_meta(n_cols, topk))
    return rows


def gather_sum(rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """rows [T*k, h] contiguous, inverse [T, k], weights [T, k] or None -> [T, h] in ``out_dtype``."""
    (num_tokens, topk), n_cols = inverse.shape, rows.shape[1]
    out = torch.empty(num_tokens, n_cols, dtype=out_dtype, device=rows.device)
    if out.numel():
        placeholder = inverse  # an unused pointer when unweighted
        meta = {k: v for k, v in _meta(n_cols, topk).items() if k != "K_PAD"}
        _gather_sum_kernel[(num_tokens,)](rows, inverse, placeholder if weights is None else weights, out, n_cols,
                                          WEIGHTED=weights is not None, **meta)  # fmt: skip
    return out


def combine_backward(
    grad: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """grad [T, h], rows [T*k, h], inverse and weights [T, k], all contiguous -> (grad_rows [T*k, h]
    in the rows' dtype, grad_weights [T, k] in the weights' dtype, or None without ``weight_grad``)."""
    (num_tokens, topk), n_cols = inverse.shape, rows.shape[1]
    grad_rows = torch.empty_like(rows)
    grad_weights = torch.empty_like(weights) if weight_grad else None
    if grad_rows.numel():
        _combine_backward_kernel[(num_tokens,)](
            grad, rows, inverse, weights, grad_rows, grad_weights if weight_grad else weights, n_cols,
            WEIGHT_GRAD=weight_grad, **_meta(n_cols, topk),
        )  # fmt: skip
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
