"""The router after its gate GEMM in one Triton kernel each way: scores, top-k, combine weights and
the balancing statistics, for Megatron-Core's softmax (top-k first or ``--moe-router-pre-softmax``)
and sigmoid routers without groups or expert bias.

Why: in PyTorch this is ~25 small kernels forward and ~35 backward over a [T, E] tensor (softmax,
top-k, gathers, the balancing loss's second softmax, top-k and one-hot, the z-loss), each a
launch of a few microseconds of work. On an H100 the host's launches, not the GPU, set the
router's time (0.5 ms of GPU work in 2.0 ms for DeepSeek-V2-Lite's 8192 x 64), and the GPU sits
idle while the launches queue. Here a program takes ``BLOCK_T`` tokens with all E experts in
registers.

What it computes per token, from fp32 logits x [E] (the reference is ``topk_routing`` and
``token_statistics`` in ``meshtron/layers/moe``):
- the k best experts by logit, in descending order, ties to the lower index. Softmax, sigmoid and
  the normalized sigmoid are all increasing in x, so this is the top-k of every score the router
  or the balancing loss ranks by, and the counts of the balancing loss are those of the routing;
- combine weights: softmax over all experts picked at the k (pre-softmax), softmax over the k
  chosen logits (top-k first), or the chosen sigmoids renormalized to sum 1 when k > 1; times
  the scaling factor;
- the balancing scores (softmax, or sigmoid / its sum) and the chosen-expert indicator summed over
  the program's tokens, and logsumexp(x)^2 for the z-loss: per-program partial sums, added up by
  the caller (deterministic: no atomics), per sequence when a program's tokens lie in one.

Backward recomputes the scores from the logits and sums every path's gradient into one fp32 dx
per token: the combine weights', the balancing scores' (a gradient per sequence and expert,
broadcast to its tokens) and the z-loss's.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _scores(logits_ptr, stride_t, T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's block of tokens: their logits in fp32 (padding experts at -inf, padding
    tokens at 0) and the scores: softmax pieces (max m, p = exp(x - m), its sum), softmax, sigmoid."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok, col_ok = rows < T, cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    x = tl.where(col_ok[None, :], x.to(tl.float32), float("-inf"))
    m = tl.max(x, 1)
    p = tl.exp(x - m[:, None])
    s = tl.sum(p, 1)
    sig = tl.where(col_ok[None, :], tl.sigmoid(x), 0.0)
    return pid, rows, row_ok, cols, x, m, p, s, p / s[:, None], sig


@triton.jit
def _kth_best(work, cols, BLOCK_E: tl.constexpr):
    """The best remaining expert of each token (ties to the lower index) as (index, one-hot mask)."""
    best = tl.max(work, 1)
    index = tl.min(tl.where(work == best[:, None], cols[None, :], BLOCK_E), 1)
    return index, cols[None, :] == index[:, None]


@triton.jit
def _route_forward_kernel(
    logits_ptr, probs_ptr, experts_ptr, score_part_ptr, count_part_ptr, z_part_ptr,
    T, E, stride_t, scaling,
    K: tl.constexpr, SOFTMAX: tl.constexpr, PRE_SOFTMAX: tl.constexpr, STATS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    pid, rows, row_ok, cols, x, m, p, s, soft, sig = _scores(logits_ptr, stride_t, T, E, BLOCK_T, BLOCK_E)
    # Pass 1: which experts are chosen, so the combine weights' normalizers are known.
    chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    work = x
    for _ in tl.static_range(K):
        _, one_hot = _kth_best(work, cols, BLOCK_E)
        chosen = chosen | one_hot
        work = tl.where(one_hot, float("-inf"), work)
    if SOFTMAX:
        if PRE_SOFTMAX:
            weight = soft
        else:
            top = tl.where(chosen, p, 0.0)  # the best logit is the row max: exp(x - m) over the chosen
            weight = top / tl.sum(top, 1)[:, None]
    else:
        weight = tl.where(chosen, sig, 0.0)
        if K > 1:
            weight = weight / (tl.sum(weight, 1)[:, None] + 1e-20)
    weight = weight * scaling
    # Pass 2: the same choices in order, written out.
    work = x
    for j in tl.static_range(K):
        index, one_hot = _kth_best(work, cols, BLOCK_E)
        tl.store(experts_ptr + rows * K + j, index.to(tl.int64), mask=row_ok)
        tl.store(probs_ptr + rows * K + j, tl.sum(tl.where(one_hot, weight, 0.0), 1).to(probs_ptr.dtype.element_ty), mask=row_ok)
        work = tl.where(one_hot, float("-inf"), work)
    if STATS:
        if SOFTMAX:
            balance = soft
        else:
            balance = sig / (tl.sum(sig, 1)[:, None] + 1e-20)
        valid = row_ok[:, None] & (cols[None, :] < E)
        tl.store(score_part_ptr + pid * E + cols, tl.sum(tl.where(valid, balance, 0.0), 0), mask=cols < E)
        tl.store(count_part_ptr + pid * E + cols, tl.sum(tl.where(valid & chosen, 1.0, 0.0), 0), mask=cols < E)
        lse = m + tl.log(s)
        tl.store(z_part_ptr + pid, tl.sum(tl.where(row_ok, lse * lse, 0.0), 0))


@triton.jit
def _route_backward_kernel(
    logits_ptr, experts_ptr, grad_probs_ptr, grad_scores_ptr, grad_z_ptr, grad_logits_ptr,
    T, E, stride_t, stride_gt, scaling, tokens_per_row,
    K: tl.constexpr, SOFTMAX: tl.constexpr, PRE_SOFTMAX: tl.constexpr, STATS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    _, rows, row_ok, cols, x, m, p, s, soft, sig = _scores(logits_ptr, stride_t, T, E, BLOCK_T, BLOCK_E)
    col_ok = cols < E
    # The combine weights' gradient, scattered to the chosen experts' columns (times the scaling).
    grad_w = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    for j in tl.static_range(K):
        index = tl.load(experts_ptr + rows * K + j, mask=row_ok, other=0)
        g = tl.load(grad_probs_ptr + rows * K + j, mask=row_ok, other=0.0).to(tl.float32)
        one_hot = cols[None, :] == index[:, None]
        grad_w += tl.where(one_hot, g[:, None] * scaling, 0.0)
        chosen = chosen | one_hot
    grad_soft = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)  # dL/d softmax(x), through the full softmax
    grad_sig = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)  # dL/d sigmoid(x)
    dx = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    if SOFTMAX:
        if PRE_SOFTMAX:
            grad_soft += grad_w
        else:  # softmax over the chosen logits: P (g - sum P g) on the chosen, nothing elsewhere
            top = tl.where(chosen, p, 0.0)
            weight = top / tl.sum(top, 1)[:, None]
            dx += weight * (grad_w - tl.sum(weight * grad_w, 1)[:, None])
    else:
        w = tl.where(chosen, sig, 0.0)
        if K > 1:  # w / (sum w + eps): dg_j / D - sum_i g_i w_i / D^2
            d = tl.sum(w, 1) + 1e-20
            grad_sig += tl.where(chosen, grad_w / d[:, None] - (tl.sum(grad_w * w, 1) / (d * d))[:, None], 0.0)
        else:
            grad_sig += tl.where(chosen, grad_w, 0.0)
    if STATS:
        sequence = rows // tokens_per_row
        g_scores = tl.load(grad_scores_ptr + sequence[:, None] * E + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if SOFTMAX:
            grad_soft += g_scores
        else:  # balance = sig / (sum sig + eps)
            d = tl.sum(sig, 1) + 1e-20
            grad_sig += g_scores / d[:, None] - (tl.sum(g_scores * sig, 1) / (d * d))[:, None]
        lse = m + tl.log(s)
        dx += tl.load(grad_z_ptr) * 2.0 * lse[:, None] * soft  # d lse^2 / dx
    dx += soft * (grad_soft - tl.sum(soft * grad_soft, 1)[:, None])
    dx += grad_sig * sig * (1.0 - sig)
    ptrs = grad_logits_ptr + rows[:, None].to(tl.int64) * stride_gt + cols[None, :]
    tl.store(ptrs, dx.to(grad_logits_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_tokens(num_experts: int) -> int:
    """Tokens per program: a [BLOCK_T, next_pow2(E)] fp32 tile of ~4 K values per array."""
    return max(1, min(64, 4096 // triton.next_power_of_2(num_experts)))


def _launch_meta(logits: torch.Tensor, k: int, softmax: bool, pre_softmax: bool, stats: bool) -> dict:
    experts = logits.shape[1]
    meta = dict(K=k, SOFTMAX=softmax, PRE_SOFTMAX=pre_softmax, STATS=stats,
                BLOCK_T=block_tokens(experts), BLOCK_E=triton.next_power_of_2(experts))  # fmt: skip
    if os.environ.get("TRITON_INTERPRET") != "1":
        meta["num_warps"] = 4
    return meta


class FusedRouting(torch.autograd.Function):
    """logits [T, E] -> probs [T, k] (logits' dtype), experts [T, k] int64, and, with ``stats``, the
    per-sequence sums over tokens: balancing scores [rows, E], chosen counts [rows, E] (no
    gradient) and logsumexp^2 [1], all fp32. ``rows`` sequences of T / rows tokens each; a
    program's tokens must lie in one sequence (T / rows a multiple of ``block_tokens(E)``, or
    rows = 1)."""

    @staticmethod
    def forward(ctx, logits, k: int, softmax: bool, pre_softmax: bool, scaling: float, rows: int, stats: bool):
        tokens, experts = logits.shape
        logits = logits.contiguous()
        meta = _launch_meta(logits, k, softmax, pre_softmax, stats)
        programs = triton.cdiv(tokens, meta["BLOCK_T"])
        probs = torch.empty(tokens, k, dtype=logits.dtype, device=logits.device)
        chosen = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
        score_part = torch.empty(programs if stats else 1, experts, dtype=torch.float32, device=logits.device)
        count_part, z_part = torch.empty_like(score_part), torch.empty(score_part.shape[0], dtype=torch.float32, device=logits.device)
        if tokens:
            _route_forward_kernel[(programs,)](logits, probs, chosen, score_part, count_part, z_part,
                                               tokens, experts, logits.stride(0), scaling, **meta)  # fmt: skip
        ctx.save_for_backward(logits, chosen)
        ctx.settings = (k, softmax, pre_softmax, scaling, rows, stats)
        ctx.mark_non_differentiable(chosen)
        if not stats:
            return probs, chosen, None, None, None
        per_row = lambda part: part.view(rows, -1, experts).sum(1) if rows > 1 else part.sum(0, keepdim=True)  # noqa: E731
        counts = per_row(count_part)
        ctx.mark_non_differentiable(counts)
        return probs, chosen, per_row(score_part), counts, z_part.sum().reshape(1)

    @staticmethod
    def backward(ctx, grad_probs, _grad_chosen, grad_scores, _grad_counts, grad_z):
        logits, chosen = ctx.saved_tensors
        k, softmax, pre_softmax, scaling, rows, stats = ctx.settings
        tokens, experts = logits.shape
        grad_logits = torch.empty_like(logits)
        if tokens == 0:
            return grad_logits, None, None, None, None, None, None
        meta = _launch_meta(logits, k, softmax, pre_softmax, stats)
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=logits.device)  # noqa: E731
        grad_probs = zeros(tokens, k) if grad_probs is None else grad_probs.contiguous()
        grad_scores = zeros(rows, experts) if grad_scores is None else grad_scores.float().contiguous()
        grad_z = zeros(1) if grad_z is None else grad_z.float()
        _route_backward_kernel[(triton.cdiv(tokens, meta["BLOCK_T"]),)](
            logits, chosen, grad_probs, grad_scores, grad_z, grad_logits,
            tokens, experts, logits.stride(0), grad_logits.stride(0), scaling, tokens // rows, **meta,
        )  # fmt: skip
        return grad_logits, None, None, None, None, None, None
