"""Triton kernel for FP8 casts: one pass over a 2-D tensor that writes its scaled FP8 copy
row-major, transposed, or both, and max-reduces its amax into a device fp32 scalar.

The FP8 linear needs each operand twice, once per GEMM layout (``_scaled_mm`` reads its second
operand column-major): casting both copies from one read of the bf16 tensor, with the amax of
delayed scaling computed on the way, replaces an amax pass, a cast pass and a transposed copy.
One kernel serves a per-tensor scale, a scale per row and a scale per column (``SCALE``): a
per-tensor scale is loaded once per program, not once per element (a broadcast load per element
was as many load instructions as the tile has values). Imported only when a kernel runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshtron.kernels import interpreted

# (rows, columns, warps) of a tile: the transposed store stays coalesced after Triton's layout
# change; benchmarks/fp8_cast_sweep.py times the candidates on a GPU.
TILE = (64, 64, 4)
# Mantissa bits and smallest normal exponent of each format the kernel rounds to, for the
# interpreter: the OCP FP8 formats, the fnuz ones (AMD gfx942: exponent bias one higher), bf16, fp16.
GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14), torch.float8_e4m3fnuz: (3, -7),
         torch.float8_e5m2fnuz: (2, -15), torch.bfloat16: (7, -126), torch.float16: (10, -14)}  # fmt: skip


@triton.jit
def round_to_grid(y, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """``y`` (fp32, within the format's range) rounded to nearest-even on a narrower float's grid.

    Only under Triton's interpreter, whose numpy conversions to FP8 and bf16 do not round to
    nearest-even (carries into the exponent, subnormals, ties) but convert representable values
    exactly; compiled kernels convert with the hardware's round-to-nearest-even.
    """
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)
    quantum = ((exponent - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    steps = tl.abs(y) / quantum  # exact: a power-of-two quantum
    whole = tl.floor(steps)
    rest = steps - whole
    odd = (whole - 2.0 * tl.floor(whole * 0.5)) == 1.0
    rounded = tl.where((rest > 0.5) | ((rest == 0.5) & odd), whole + 1.0, whole) * quantum
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -rounded, rounded)  # the sign bit: -0.0 stays negative


@triton.jit
def _cast_kernel(
    x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, rows, cols, fmax, labels_ptr, lse_ptr, grad_ptr, start, SCALE: tl.constexpr,
    CE_GRADIENT: tl.constexpr, WRITE_ROWS: tl.constexpr, WRITE_TRANSPOSED: tl.constexpr, AMAX: tl.constexpr,
    ROUND_FIRST: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, IN_MANTISSA: tl.constexpr,
    IN_MIN_EXPONENT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r2, c2 = r.to(tl.int64)[:, None], c.to(tl.int64)[None, :]
    mask = (r2 < rows) & (c2 < cols)
    x = tl.load(x_ptr + r2 * cols + c2, mask=mask, other=0.0)
    if CE_GRADIENT:  # x holds logits: first their gradient (softmax - onehot(label)) * grad, in x's dtype
        row_ok = r2 < rows
        lse = tl.load(lse_ptr + r2, mask=row_ok, other=0.0)
        label = tl.load(labels_ptr + r2, mask=row_ok, other=-1) - start
        p = tl.exp(x.to(tl.float32) - lse)
        g = tl.where(c2 == label, p - 1.0, p) * tl.load(grad_ptr + r2, mask=row_ok, other=0.0)
        if ROUND_FIRST and IN_MANTISSA > 0:
            g = round_to_grid(g, IN_MANTISSA, IN_MIN_EXPONENT)
        x = tl.where(mask, g, 0.0).to(x.dtype, fp_downcast_rounding="rtne")
    if AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0))
    if WRITE_ROWS or WRITE_TRANSPOSED:
        if SCALE == 0:  # one for the tensor
            scale = tl.load(scale_ptr)
        elif SCALE == 1:  # one per row
            scale = tl.load(scale_ptr + r2, mask=r2 < rows, other=1.0)
        else:  # one per column
            scale = tl.load(scale_ptr + c2, mask=c2 < cols, other=1.0)
        # The fp32 product rounded to the input's dtype first, as the reference does (and as
        # a direct fp32 -> FP8 store gave wrong values on an H100 with Triton 3.6: neighbours duplicated).
        y = x.to(tl.float32) * scale
        if ROUND_FIRST and IN_MANTISSA > 0:
            y = round_to_grid(y, IN_MANTISSA, IN_MIN_EXPONENT)
        y = y.to(x.dtype, fp_downcast_rounding="rtne").to(tl.float32)
        y = tl.minimum(tl.maximum(y, -fmax), fmax)
        if ROUND_FIRST:
            y = round_to_grid(y, MANTISSA, MIN_EXPONENT)
        if WRITE_ROWS:
            tl.store(q_ptr + r2 * cols + c2, y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        if WRITE_TRANSPOSED:  # the tile transposed in fp32, then cast: no layout change of FP8 values
            qt = tl.trans(y).to(qt_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(qt_ptr + tl.trans(c2 * rows + r2), qt, mask=tl.trans(mask))


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, write_rows: bool, write_transposed: bool,
         compute_amax: bool, tile: tuple[int, int, int] = TILE,
         ce_gradient: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [rows, cols] contiguous -> (FP8 copy [rows, cols], FP8 transpose [cols, rows], amax fp32 0-d);
    copies not asked for come back empty, the amax as zero. ``scale`` is 0-d, [rows, 1] or [1, cols].

    ``ce_gradient`` (labels [rows], fp32 lse [rows], fp32 grad [rows], start): ``x`` holds a chunk of
    logits (vocabulary columns ``start``..), and what is cast is their cross-entropy gradient
    ``(softmax - onehot(label)) * grad`` in ``x``'s dtype (``cross_entropy.chunk_backward_reference``),
    made in the same pass: the gradient is never written in the compute dtype (the FP8 output layer)."""
    block_r, block_c, warps = tile
    rows, cols = x.shape
    q = torch.empty((rows, cols) if write_rows else (0,), dtype=dtype, device=x.device)
    qt = torch.empty((cols, rows) if write_transposed else (0,), dtype=dtype, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    scale = scale.float().contiguous()
    kinds = {(0, 0): 0, (1, 0): 1, (0, 1): 2}  # the scale's broadcast strides -> SCALE
    strides = scale.expand(rows, cols).stride() if scale.numel() > 1 else (0, 0)
    if strides not in kinds:
        raise ValueError(f"scale of shape {tuple(scale.shape)}: give one value, [rows, 1] or [1, cols] for [{rows}, {cols}]")
    mantissa, min_exponent = GRID[dtype]
    in_mantissa, in_min_exponent = GRID.get(x.dtype, (0, 0))  # fp32 input: the product needs no rounding
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    spare = torch.empty(1, dtype=dtype, device=x.device)  # stands for a copy not written
    labels, lse, grad, start = ce_gradient if ce_gradient is not None else (amax, amax, amax, 0)  # unread without it
    _cast_kernel[grid](
        x, q if write_rows else spare, qt if write_transposed else spare, scale, amax, rows, cols,
        torch.finfo(dtype).max, labels, lse, grad, start, SCALE=kinds[strides], CE_GRADIENT=ce_gradient is not None, WRITE_ROWS=write_rows, WRITE_TRANSPOSED=write_transposed,
        AMAX=compute_amax, ROUND_FIRST=interpreted(), MANTISSA=mantissa,
        MIN_EXPONENT=min_exponent, IN_MANTISSA=in_mantissa, IN_MIN_EXPONENT=in_min_exponent, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    return q, qt, amax
