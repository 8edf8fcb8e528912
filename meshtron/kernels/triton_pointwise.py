"""Triton kernels for the row-wise and elementwise ops: cross-entropy chunk steps, SwiGLU, bias +
GELU, RoPE, dropout + residual add, the fp32 gate's three-way bf16 split.

Imported only when a kernel runs (``meshtron.kernels.use_triton``), so Triton stays optional.
Each kernel reads its input once and writes its output once, computing in fp32 whatever the
storage dtype; the plain-PyTorch references (in the sibling modules) define the numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------- cross-entropy chunks


@triton.jit
def _ce_forward_kernel(logits_ptr, labels_ptr, lse_ptr, target_ptr, stride, n_cols, start, BLOCK: tl.constexpr):
    """One row: online log-sum-exp over the chunk, and the label's logit if it lies in the chunk."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = float("-inf")
    d = 0.0
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    local = tl.load(labels_ptr + row) - start
    inside = (local >= 0) & (local < n_cols)
    target = tl.load(base + local, mask=inside, other=0.0).to(tl.float32)
    tl.store(lse_ptr + row, m + tl.log(d))
    tl.store(target_ptr + row, target)


@triton.jit
def _ce_backward_kernel(logits_ptr, labels_ptr, lse_ptr, grad_ptr, stride, n_cols, start, BLOCK: tl.constexpr):
    """One row, in place: logits -> (softmax - onehot(label)) * grad."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    lse = tl.load(lse_ptr + row)
    grad = tl.load(grad_ptr + row)
    local = tl.load(labels_ptr + row) - start
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(cols == local, p - 1.0, p)
        tl.store(base + cols, (p * grad).to(logits_ptr.dtype.element_ty), mask=mask)


_CE_BLOCK = 2048


def ce_chunk_forward(logits: torch.Tensor, labels: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``cross_entropy.chunk_forward_reference``."""
    n, cols = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    target = torch.empty_like(lse)
    _ce_forward_kernel[(n,)](logits, labels, lse, target, logits.stride(0), cols, start, BLOCK=_CE_BLOCK, num_warps=8)
    return lse, target


def ce_chunk_backward(
    logits: torch.Tensor, labels: torch.Tensor, start: int, lse: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """Same contract as ``cross_entropy.chunk_backward_reference``."""
    n, cols = logits.shape
    _ce_backward_kernel[(n,)](logits, labels, lse, grad, logits.stride(0), cols, start, BLOCK=_CE_BLOCK, num_warps=8)
    return logits


# ---------------------------------------------------------------------- SwiGLU


@triton.jit
def _swiglu_forward_kernel(h_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    """out[r, c] = silu(h[r, c]) * h[r, n_cols + c]; h is [rows, 2 * n_cols] (gate first)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(h_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(h_ptr, grad_out_ptr, grad_h_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(h_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_out_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = g * gate * sig
    tl.store(grad_h_ptr + row * 2 * n_cols + cols, d_gate.to(grad_h_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_h_ptr + row * 2 * n_cols + n_cols + cols, d_up.to(grad_h_ptr.dtype.element_ty), mask=mask)


_SWIGLU_BLOCK = 1024


def swiglu_forward(h: torch.Tensor) -> torch.Tensor:
    """h [rows, 2F] contiguous -> [rows, F]."""
    rows, width = h.shape[0], h.shape[1] // 2
    out = torch.empty((rows, width), dtype=h.dtype, device=h.device)
    _swiglu_forward_kernel[(rows, triton.cdiv(width, _SWIGLU_BLOCK))](h, out, width, BLOCK=_SWIGLU_BLOCK)
    return out


def swiglu_backward(h: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    rows, width = h.shape[0], h.shape[1] // 2
    grad_h = torch.empty_like(h)
    grid = (rows, triton.cdiv(width, _SWIGLU_BLOCK))
    _swiglu_backward_kernel[grid](h, grad_out, grad_h, width, BLOCK=_SWIGLU_BLOCK)
    return grad_h


# ---------------------------------------------------------------------- bias + GELU


@triton.jit
def _gelu_and_slope(x, TANH: tl.constexpr):
    """(gelu(x), gelu'(x)) in fp32: the exact erf form, or (TANH) the tanh approximation."""
    if TANH:
        k = 0.7978845608028654  # sqrt(2 / pi)
        inner = k * (x + 0.044715 * x * x * x)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner)
        return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x)
    cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    return x * cdf, cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)


@triton.jit
def _bias_gelu_forward_kernel(h_ptr, bias_ptr, out_ptr, n_cols, TANH: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, c] = gelu(h[r, c] + bias[c])."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(h_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out, _ = _gelu_and_slope(x, TANH)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_backward_kernel(h_ptr, bias_ptr, grad_ptr, grad_h_ptr, partial_ptr, n_rows, n_cols,
                               TANH: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """grad_h = grad * gelu'(h + bias) over ``ROWS`` rows and ``BLOCK_C`` columns, and those rows'
    column sums of grad_h (fp32) into row ``program_id(0)`` of ``partial``: the bias gradient's
    share, so grad_h is never read again to sum it."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    first = tl.program_id(0).to(tl.int64) * ROWS
    for r in range(0, ROWS, BLOCK_R):
        rows = first + r + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
        _, slope = _gelu_and_slope(x, TANH)
        grad_h = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * slope
        grad_h = tl.where(mask, grad_h, 0.0)
        tl.store(grad_h_ptr + offs, grad_h.to(grad_h_ptr.dtype.element_ty), mask=mask)
        acc += tl.sum(grad_h, axis=0)
    tl.store(partial_ptr + tl.program_id(0) * n_cols + cols, acc, mask=col_mask)


_GELU_BLOCK = 1024
_GELU_ROWS, _GELU_BLOCK_R, _GELU_BLOCK_C = 256, 32, 128


def bias_gelu_forward(h: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    """h [rows, cols] contiguous, bias [cols] -> gelu(h + bias) in h's dtype."""
    rows, cols = h.shape
    out = torch.empty_like(h)
    _bias_gelu_forward_kernel[(rows, triton.cdiv(cols, _GELU_BLOCK))](h, bias, out, cols, TANH=tanh, BLOCK=_GELU_BLOCK)
    return out


def bias_gelu_backward(h: torch.Tensor, bias: torch.Tensor, grad: torch.Tensor, tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of h in h's dtype, grad of bias in bias's dtype, summed over the rows in fp32)."""
    rows, cols = h.shape
    grad_h = torch.empty_like(h)
    partial = torch.empty((triton.cdiv(rows, _GELU_ROWS), cols), dtype=torch.float32, device=h.device)
    grid = (partial.shape[0], triton.cdiv(cols, _GELU_BLOCK_C))
    _bias_gelu_backward_kernel[grid](h, bias, grad, grad_h, partial, rows, cols, TANH=tanh, ROWS=_GELU_ROWS,
                                     BLOCK_R=_GELU_BLOCK_R, BLOCK_C=_GELU_BLOCK_C, num_warps=4)  # fmt: skip
    return grad_h, partial.sum(0).to(bias.dtype)


# ---------------------------------------------------------------------- RoPE


@triton.jit
def token_position(pos_ptr, seq_len, HAS_POS: tl.constexpr):
    """One token per program: its index, batch row, place in the row, and position (its entry of
    ``pos_ptr`` [b * s], else its place in the row)."""
    pid = tl.program_id(0).to(tl.int64)
    b, s = pid // seq_len, pid % seq_len
    if HAS_POS:
        pos = tl.load(pos_ptr + pid).to(tl.int64)
    else:
        pos = s
    return pid, b, s, pos


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr,
    seq_len, num_heads, sxb, sxs, sxh, sob, sos, soh, table_stride,
    SIGN: tl.constexpr, HAS_POS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """All heads of one token: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), sin negated by SIGN=-1
    (the inverse rotation, which is the backward pass)."""
    _, b, s, pos = token_position(pos_ptr, seq_len, HAS_POS)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    cos = tl.load(cos_ptr + pos * table_stride + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * table_stride + dims, mask=dims < HALF, other=0.0) * SIGN
    src = x_ptr + b * sxb + s * sxs + heads * sxh + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + b * sob + s * sos + heads * soh + dims
    dtype = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None, sign: int) -> torch.Tensor:
    """Rotate x [b, s, heads, d] (any strides, last dim contiguous) into a new contiguous tensor.

    ``cos``/``sin`` are the fp32 [positions, d] tables (halves equal); ``sign=-1`` rotates back.
    """
    b, s, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((b, s, heads, d), dtype=x.dtype, device=x.device)
    pos = position_ids.expand(b, s).contiguous() if position_ids is not None else x  # x: an unused placeholder
    _rope_kernel[(b * s,)](
        x, out, cos, sin, pos, s, heads, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1),
        out.stride(2), cos.stride(0), SIGN=sign, HAS_POS=position_ids is not None, HALF=d // 2,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(d // 2),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------- scaled write into fp32


@triton.jit
def _scale_into_kernel(x_ptr, out_ptr, scale_ptr, n, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(scale_ptr)
    if ACCUMULATE:
        y += tl.load(out_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, y, mask=mask)


def scale_into(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, accumulate: bool) -> None:
    """``out = x * scale`` (``accumulate``: ``out += x * scale``) in fp32, one pass: ``out`` fp32,
    ``x`` any float dtype, both contiguous and of one size, ``scale`` a 0-d fp32 tensor."""
    n = x.numel()
    _scale_into_kernel[(triton.cdiv(n, 4096),)](x, out, scale, n, ACCUMULATE=accumulate, BLOCK=4096, num_warps=8)


# ---------------------------------------------------------------------- dropout + residual add


@triton.jit
def _uniforms(seed_ptr, start, QUARTER: tl.constexpr):
    """Four uniforms for each of ``QUARTER`` counters: one Philox call (as curand's 4x32-10) serves
    element j of each quarter of the block ``start ..< start + 4 * QUARTER``. The counter is
    start / 4 + j in 31 bits and the seed is offset by the rest (a block never straddles the
    boundary), so no two elements of a tensor share a draw."""
    seed = tl.load(seed_ptr) + (start >> 33)
    counters = ((start >> 2) & 0x7FFFFFFF).to(tl.int32) + tl.arange(0, QUARTER)
    return tl.rand4x(seed, counters)


@triton.jit
def _dropout_add_quarter(x_ptr, residual_ptr, out_ptr, first, n, kept, scale, QUARTER: tl.constexpr):
    offs = first + tl.arange(0, QUARTER)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = residual + tl.where(kept, x * scale, 0.0)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_add_kernel(x_ptr, residual_ptr, out_ptr, seed_ptr, n, p, scale, QUARTER: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * 4 * QUARTER
    u0, u1, u2, u3 = _uniforms(seed_ptr, start, QUARTER)
    _dropout_add_quarter(x_ptr, residual_ptr, out_ptr, start, n, u0 > p, scale, QUARTER)
    _dropout_add_quarter(x_ptr, residual_ptr, out_ptr, start + QUARTER, n, u1 > p, scale, QUARTER)
    _dropout_add_quarter(x_ptr, residual_ptr, out_ptr, start + 2 * QUARTER, n, u2 > p, scale, QUARTER)
    _dropout_add_quarter(x_ptr, residual_ptr, out_ptr, start + 3 * QUARTER, n, u3 > p, scale, QUARTER)


@triton.jit
def _dropout_grad_quarter(grad_ptr, grad_x_ptr, first, n, kept, scale, QUARTER: tl.constexpr):
    offs = first + tl.arange(0, QUARTER)
    mask = offs < n
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(grad_x_ptr + offs, tl.where(kept, grad * scale, 0.0).to(grad_x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_backward_kernel(grad_ptr, grad_x_ptr, seed_ptr, n, p, scale, QUARTER: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * 4 * QUARTER
    u0, u1, u2, u3 = _uniforms(seed_ptr, start, QUARTER)
    _dropout_grad_quarter(grad_ptr, grad_x_ptr, start, n, u0 > p, scale, QUARTER)
    _dropout_grad_quarter(grad_ptr, grad_x_ptr, start + QUARTER, n, u1 > p, scale, QUARTER)
    _dropout_grad_quarter(grad_ptr, grad_x_ptr, start + 2 * QUARTER, n, u2 > p, scale, QUARTER)
    _dropout_grad_quarter(grad_ptr, grad_x_ptr, start + 3 * QUARTER, n, u3 > p, scale, QUARTER)


_DROPOUT_QUARTER = 1024  # a program takes 4 x 1024 elements


def dropout_add_forward(x: torch.Tensor, residual: torch.Tensor, seed: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``residual + x * keep / (1 - p)`` in ``dtype``; x, residual contiguous of one shape, 0 <= p < 1."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.numel()
    grid = (triton.cdiv(n, 4 * _DROPOUT_QUARTER),)
    _dropout_add_kernel[grid](x, residual, out, seed, n, p, 1.0 / (1.0 - p), QUARTER=_DROPOUT_QUARTER, num_warps=8)
    return out


def dropout_backward(grad: torch.Tensor, seed: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``grad * keep / (1 - p)`` in ``dtype``, the mask recomputed from ``seed`` as the forward drew it."""
    grad_x = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    n = grad.numel()
    grid = (triton.cdiv(n, 4 * _DROPOUT_QUARTER),)
    _dropout_backward_kernel[grid](grad, grad_x, seed, n, p, 1.0 / (1.0 - p), QUARTER=_DROPOUT_QUARTER, num_warps=8)
    return grad_x


# ---------------------------------------------------------------------- fp32 -> three bf16 pieces


@triton.jit
def _split_in_three_kernel(g_ptr, out_ptr, n, n_cols, BLOCK: tl.constexpr):
    """g [rows, n_cols] fp32 -> out [rows, 3 n_cols] bf16 = [hi | mid | lo], each rounded to nearest."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + i, mask=ok, other=0.0)
    hi = g.to(tl.bfloat16)
    rest = g - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    at = out_ptr + (i // n_cols) * (3 * n_cols) + i % n_cols
    tl.store(at, hi, mask=ok)
    tl.store(at + n_cols, mid, mask=ok)
    tl.store(at + 2 * n_cols, lo, mask=ok)


def split_in_three(g: torch.Tensor) -> torch.Tensor:
    """``fp32_gate.split_in_three`` in one kernel: g [T, E] fp32 contiguous -> [T, 3E] bf16."""
    out = torch.empty(g.shape[0], 3 * g.shape[1], dtype=torch.bfloat16, device=g.device)
    if g.numel():
        _split_in_three_kernel[(triton.cdiv(g.numel(), 1024),)](g, out, g.numel(), g.shape[1], BLOCK=1024)
    return out
