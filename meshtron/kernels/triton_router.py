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
  the program's tokens, and logsumexp(x)^2 for the z-loss: per-program partial sums, added up in
  a fixed order by a second, one-program kernel (deterministic: no atomics), per sequence when a
  program's tokens lie in one. Given the losses' coefficients, that kernel also computes the
  balancing and z losses (``balancing.losses_from_statistics``' formulas where the sums are
  already the micro batch's), which then cost no PyTorch op either way.

Backward recomputes the scores from the logits and sums every path's gradient into one fp32 dx
per token: the combine weights', the balancing scores' (a gradient per sequence and expert,
broadcast to its tokens; from the balancing loss, its scalar gradient times the chosen counts)
and the z-loss's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshtron.kernels import interpreted


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
    logits_ptr, experts_ptr, grad_probs_ptr, scores_grad_ptr, balance_grad_ptr, z_grad_ptr, grad_logits_ptr,
    T, E, stride_t, stride_gt, scaling, tokens_per_row, balance_scale, z_scale,
    K: tl.constexpr, SOFTMAX: tl.constexpr, PRE_SOFTMAX: tl.constexpr, SCORES_GRAD: tl.constexpr,
    FROM_COUNTS: tl.constexpr, Z_GRAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """dx of the combine weights, of the balancing scores' sums (``SCORES_GRAD``: [rows, E] at
    ``scores_grad_ptr``, or with ``FROM_COUNTS`` the balancing loss's: the chosen counts there times
    its gradient and ``balance_scale``) and of the z sum (``Z_GRAD``: the scalar at ``z_grad_ptr``
    times ``z_scale``)."""
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
    if SCORES_GRAD:
        sequence = rows // tokens_per_row
        g_scores = tl.load(scores_grad_ptr + sequence[:, None] * E + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if FROM_COUNTS:
            g_scores = g_scores * (tl.load(balance_grad_ptr).to(tl.float32) * balance_scale)
        if SOFTMAX:
            grad_soft += g_scores
        else:  # balance = sig / (sum sig + eps)
            d = tl.sum(sig, 1) + 1e-20
            grad_sig += g_scores / d[:, None] - (tl.sum(g_scores * sig, 1) / (d * d))[:, None]
    if Z_GRAD:
        lse = m + tl.log(s)
        dx += (tl.load(z_grad_ptr).to(tl.float32) * z_scale) * 2.0 * lse[:, None] * soft  # d lse^2 / dx
    dx += soft * (grad_soft - tl.sum(soft * grad_soft, 1)[:, None])
    dx += grad_sig * sig * (1.0 - sig)
    ptrs = grad_logits_ptr + rows[:, None].to(tl.int64) * stride_gt + cols[None, :]
    tl.store(ptrs, dx.to(grad_logits_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _route_sums_kernel(
    score_part_ptr, count_part_ptr, z_part_ptr, scores_ptr, counts_ptr, z_ptr, losses_ptr,
    E, programs, rows, balance_scale, z_scale, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """One program: the forward's per-program partial sums added up per sequence (``rows`` of
    programs / rows programs each) into scores and counts [rows, E] and z [1], and the losses [2]:
    ``balance_scale`` * sum(scores * counts) and ``z_scale`` * z."""
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    blocks = tl.arange(0, BLOCK_P)
    per_row = programs // rows
    balance = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for r in range(rows):
        scores = tl.zeros((BLOCK_E,), dtype=tl.float32)
        counts = tl.zeros((BLOCK_E,), dtype=tl.float32)
        for first in range(0, per_row, BLOCK_P):
            part = r * per_row + first + blocks
            ok = ((first + blocks) < per_row)[:, None] & col_ok[None, :]
            scores += tl.sum(tl.load(score_part_ptr + part[:, None] * E + cols[None, :], mask=ok, other=0.0), 0)
            counts += tl.sum(tl.load(count_part_ptr + part[:, None] * E + cols[None, :], mask=ok, other=0.0), 0)
        tl.store(scores_ptr + r * E + cols, scores, mask=col_ok)
        tl.store(counts_ptr + r * E + cols, counts, mask=col_ok)
        balance += scores * counts
    z = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for first in range(0, programs, BLOCK_P):
        z += tl.load(z_part_ptr + first + blocks, mask=(first + blocks) < programs, other=0.0)
    z_sum = tl.sum(z, 0)
    tl.store(z_ptr, z_sum)
    tl.store(losses_ptr, tl.sum(balance, 0) * balance_scale)
    tl.store(losses_ptr + 1, z_sum * z_scale)


def block_tokens(num_experts: int) -> int:
    """Tokens per program: a [BLOCK_T, next_pow2(E)] fp32 tile of ~4 K values per array."""
    return max(1, min(64, 4096 // triton.next_power_of_2(num_experts)))


_INTERPRETED = interpreted()  # read at import, as Triton reads it


def _launch_meta(logits: torch.Tensor, k: int, softmax: bool, pre_softmax: bool) -> dict:
    experts = logits.shape[1]
    meta = dict(K=k, SOFTMAX=softmax, PRE_SOFTMAX=pre_softmax, BLOCK_T=block_tokens(experts), BLOCK_E=triton.next_power_of_2(experts))
    if not _INTERPRETED:
        meta["num_warps"] = 4
    return meta


def loss_scales(tokens: int, experts: int, k: int, rows: int, coefficients: tuple[float, float]) -> tuple[float, float]:
    """The factors taking the summed statistics to the losses: ``aux * E * mean over rows of
    sum_e (counts / (N k)) (scores / N)`` with N = tokens / rows, and ``z * z_sum / tokens``
    (``losses_from_statistics``)."""
    per_row = tokens / rows
    aux, z = coefficients
    return aux * experts / (rows * per_row * per_row * k), z / tokens


class FusedRouting(torch.autograd.Function):
    """logits [T, E] -> probs [T, k] (logits' dtype), experts [T, k] int64, and, with ``stats``, the
    per-sequence sums over tokens: balancing scores [rows, E], chosen counts [rows, E] (no
    gradient) and logsumexp^2 [1], all fp32; or, with ``coefficients`` (aux, z), instead of
    those the balancing and z losses (0-dim fp32) of sums that are already the micro batch's
    (``loss_scales``). ``rows`` sequences of T / rows tokens each; a program's tokens must lie in one sequence
    (T / rows a multiple of ``block_tokens(E)``, or rows = 1)."""

    @staticmethod
    def forward(ctx, logits, k: int, softmax: bool, pre_softmax: bool, scaling: float, rows: int, stats: bool,
                coefficients: tuple[float, float] | None = None):  # fmt: skip
        ctx.set_materialize_grads(False)  # absent gradients skip their terms rather than adding zeros
        tokens, experts = logits.shape
        logits = logits.contiguous()
        meta = _launch_meta(logits, k, softmax, pre_softmax)
        programs = triton.cdiv(tokens, meta["BLOCK_T"])
        device = logits.device
        probs = torch.empty(tokens, k, dtype=logits.dtype, device=device)
        chosen = torch.empty(tokens, k, dtype=torch.int64, device=device)
        ctx.mark_non_differentiable(chosen)
        ctx.settings = (k, softmax, pre_softmax, scaling, rows)
        ctx.scales = loss_scales(tokens, experts, k, rows, coefficients) if coefficients and tokens else (0.0, 0.0)
        if not stats:
            if tokens:  # no partial sums: their pointers unused
                _route_forward_kernel[(programs,)](logits, probs, chosen, probs, probs, probs, tokens, experts, logits.stride(0), scaling,
                                                   STATS=False, **meta)  # fmt: skip
            ctx.save_for_backward(logits, chosen, None)
            return probs, chosen, None, None, None, None, None
        # One buffer: the partial sums [programs, E] x 2 and [programs], the sums [rows, E] x 2 and [1], the 2 losses.
        parts = torch.empty((2 * experts + 1) * programs + 2 * rows * experts + 3, dtype=torch.float32, device=device)
        score_part, count_part, z_part, scores, counts, z, losses = parts.split(
            [programs * experts, programs * experts, programs, rows * experts, rows * experts, 1, 2])
        if tokens:
            _route_forward_kernel[(programs,)](logits, probs, chosen, score_part, count_part, z_part, tokens, experts, logits.stride(0),
                                               scaling, STATS=True, **meta)  # fmt: skip
        _route_sums_kernel[(1,)](score_part, count_part, z_part, scores, counts, z, losses, experts, programs, rows, *ctx.scales,
                                 BLOCK_P=32, BLOCK_E=meta["BLOCK_E"])  # fmt: skip
        ctx.save_for_backward(logits, chosen, counts)  # flat [rows * E]: the backward kernel's layout
        if coefficients is not None:
            return probs, chosen, None, None, None, losses[0], losses[1]
        counts = counts.view(rows, experts)
        ctx.mark_non_differentiable(counts)
        return probs, chosen, scores.view(rows, experts), counts, z, None, None

    @staticmethod
    def backward(ctx, grad_probs, _grad_chosen, grad_scores, _grad_counts, grad_z, grad_balance, grad_z_loss):
        logits, chosen, counts = ctx.saved_tensors
        k, softmax, pre_softmax, scaling, rows = ctx.settings
        tokens, experts = logits.shape
        grad_logits = torch.empty_like(logits)
        if tokens == 0:
            return grad_logits, None, None, None, None, None, None, None
        if grad_probs is None:
            grad_probs = torch.zeros(tokens, k, dtype=torch.float32, device=logits.device)
        # The statistics' gradients (without coefficients), or the losses' (with them; then the counts carry the scores').
        balance_scale, z_scale = ctx.scales
        from_counts = grad_balance is not None
        scores_grad = counts if from_counts else grad_scores
        z_grad, z_scale = (grad_z, 1.0) if grad_z is not None else (grad_z_loss, z_scale)
        anything = logits  # a pointer the kernel does not read
        _route_backward_kernel[(triton.cdiv(tokens, block_tokens(experts)),)](
            logits, chosen, grad_probs.contiguous(), anything if scores_grad is None else scores_grad.contiguous(),
            grad_balance if from_counts else anything, anything if z_grad is None else z_grad, grad_logits,
            tokens, experts, logits.stride(0), grad_logits.stride(0), scaling, tokens // rows, balance_scale, z_scale,
            SCORES_GRAD=scores_grad is not None, FROM_COUNTS=from_counts, Z_GRAD=z_grad is not None,
            **_launch_meta(logits, k, softmax, pre_softmax),
        )  # fmt: skip
        return grad_logits, None, None, None, None, None, None, None
