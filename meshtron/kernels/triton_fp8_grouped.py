"""Triton kernels for the FP8 experts' casts (``layers/moe/fp8_grouped_gemm.py``): stacked expert
weights [E, N, K] (each expert in nn.Linear layout) in one pass for both amaxes and one pass for
both FP8 copies, and a row-scaled activation [M, K] in one kernel.

The forward GEMM reads each expert's rows scaled per output row (one scale per (e, n), over k);
the input gradient reads each expert transposed, [E, K, N], scaled per input column (one scale
per (e, k), over n). Reading the bf16 weights once for both amaxes and once for both copies
replaces two reductions, two casts and a transposed bf16 copy. An activation's rows each get the
largest power-of-two scale that fits: each program reads its rows twice (the amax, then the cast,
the second read mostly from L2) where an amax pass, the scale's small ops and a cast pass were
separate kernels. Imported only when a kernel runs.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from meshtron.kernels import interpreted
from meshtron.kernels.fp8_cast import AMAX_FLOOR
from meshtron.kernels.triton_fp8_cast import GRID, round_to_grid

# Tiles (BLOCK_N, BLOCK_K, warps) the autotuner tries per weight shape: memory-bound passes whose
# best tile depends on the GPU (not timed here: no GPU); the interpreter runs one fixed tile.
_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in
            [(64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8)]]  # fmt: skip
_INTERPRETER_TILE = {"BLOCK_N": 32, "BLOCK_K": 32}
# Row blocks (BLOCK_M, BLOCK_K, warps) of the activation cast.
_ROW_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w) for bm, bk, w in
                [(8, 512, 4), (16, 512, 4), (32, 256, 4), (16, 1024, 8)]]  # fmt: skip
_INTERPRETER_ROWS = {"BLOCK_M": 8, "BLOCK_K": 32}
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)  # fp8_cast's: an all-zero row gets a finite scale


@triton.jit
def _amax_kernel(w_ptr, row_amax_ptr, col_amax_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Max-reduce |w| of one [BLOCK_N, BLOCK_K] tile of expert e into its rows' and columns' amaxes."""
    e = tl.program_id(0).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k = (tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    mask = (n[:, None] < N) & (k[None, :] < K)
    x = tl.abs(tl.load(w_ptr + e * N * K + n[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32))
    tl.atomic_max(row_amax_ptr + e * N + n, tl.max(x, 1), mask=n < N)
    tl.atomic_max(col_amax_ptr + e * K + k, tl.max(x, 0), mask=k < K)


@triton.jit
def _to_fp8(y, fmax, IN_DTYPE: tl.constexpr, ROUND_FIRST: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr,
            IN_MANTISSA: tl.constexpr, IN_MIN_EXPONENT: tl.constexpr):  # fmt: skip
    """fp32 ``y`` rounded as ``fp8_cast`` rounds: to the input's dtype, clamped, then (interpreter only) to FP8's grid."""
    if ROUND_FIRST and IN_MANTISSA > 0:  # an fp32 input needs no rounding
        y = round_to_grid(y, IN_MANTISSA, IN_MIN_EXPONENT)
    y = y.to(IN_DTYPE, fp_downcast_rounding="rtne").to(tl.float32)
    y = tl.minimum(tl.maximum(y, -fmax), fmax)
    if ROUND_FIRST:
        y = round_to_grid(y, MANTISSA, MIN_EXPONENT)
    return y


@triton.jit
def _cast_kernel(
    w_ptr, q_ptr, qt_ptr, row_scale_ptr, col_scale_ptr, N, K, fmax,
    WRITE_ROWS: tl.constexpr, WRITE_TRANSPOSED: tl.constexpr, ROUND_FIRST: tl.constexpr, MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr, IN_MANTISSA: tl.constexpr, IN_MIN_EXPONENT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One tile of expert e: its rows copy q[e, n, k] (row scales) and transposed copy qt[e, k, n] (column scales)."""
    e = tl.program_id(0).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k = (tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    mask = (n[:, None] < N) & (k[None, :] < K)
    w = tl.load(w_ptr + e * N * K + n[:, None] * K + k[None, :], mask=mask, other=0.0)
    x = w.to(tl.float32)
    if WRITE_ROWS:
        scale = tl.load(row_scale_ptr + e * N + n, mask=n < N, other=1.0)
        y = _to_fp8(x * scale[:, None], fmax, w.dtype, ROUND_FIRST, MANTISSA, MIN_EXPONENT, IN_MANTISSA, IN_MIN_EXPONENT)
        tl.store(q_ptr + e * N * K + n[:, None] * K + k[None, :], y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    if WRITE_TRANSPOSED:  # transposed in fp32, then cast: no layout change of FP8 values
        scale = tl.load(col_scale_ptr + e * K + k, mask=k < K, other=1.0)
        y = _to_fp8(x * scale[None, :], fmax, w.dtype, ROUND_FIRST, MANTISSA, MIN_EXPONENT, IN_MANTISSA, IN_MIN_EXPONENT)
        qt = tl.trans(y).to(qt_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(qt_ptr + e * K * N + k[:, None] * N + n[None, :], qt, mask=tl.trans(mask))


@triton.jit
def _rows_kernel(
    x_ptr, q_ptr, inv_ptr, M, K, fmax, ROUND_FIRST: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr,
    IN_MANTISSA: tl.constexpr, IN_MIN_EXPONENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """BLOCK_M rows of x: their amax, the largest power-of-two scale with amax * scale <= fmax
    (``fp8_blockwise.pow2_scale``: IEEE division, the exponent bits kept), the scaled FP8 rows and
    the inverse scales."""
    m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
    ratio = tl.math.div_rn(tl.full((BLOCK_M,), fmax, tl.float32), tl.maximum(amax, _AMAX_FLOOR))
    scale = (ratio.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = (m[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mask, other=0.0)
        y = _to_fp8(x.to(tl.float32) * scale[:, None], fmax, x.dtype, ROUND_FIRST, MANTISSA, MIN_EXPONENT, IN_MANTISSA, IN_MIN_EXPONENT)
        tl.store(q_ptr + m[:, None] * K + k[None, :], y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(inv_ptr + m, tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), scale), mask=m < M)


# Autotuning reruns a launch per tile: harmless here (a max, and copies written whole).
_amax_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K"])(_amax_kernel)
_cast_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "WRITE_ROWS", "WRITE_TRANSPOSED"])(_cast_kernel)
_rows_tuned = triton.autotune(configs=_ROW_CONFIGS, key=["K"])(_rows_kernel)


def _launch(kernel, tuned, w: torch.Tensor, *args, **meta) -> None:
    """``kernel`` over w [E, N, K]'s tiles: autotuned on a GPU, one fixed tile under the interpreter."""
    experts, n, k = w.shape
    if interpreted():
        grid = (experts, triton.cdiv(n, _INTERPRETER_TILE["BLOCK_N"]), triton.cdiv(k, _INTERPRETER_TILE["BLOCK_K"]))
        kernel[grid](w, *args, **meta, **_INTERPRETER_TILE)
    else:
        tuned[lambda c: (experts, triton.cdiv(n, c["BLOCK_N"]), triton.cdiv(k, c["BLOCK_K"]))](w, *args, **meta)


def weight_amaxes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] contiguous -> (amax over k [E, N], amax over n [E, K]), fp32."""
    experts, n, k = w.shape
    row_amax = torch.zeros(experts, n, dtype=torch.float32, device=w.device)
    col_amax = torch.zeros(experts, k, dtype=torch.float32, device=w.device)
    _launch(_amax_kernel, _amax_tuned, w, row_amax, col_amax, n, k)
    return row_amax, col_amax


def cast_weights(w: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, dtype: torch.dtype, write_rows: bool,
                 write_transposed: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """w [E, N, K] contiguous -> (rows copy [E, N, K] scaled by ``row_scale`` [E, N], transposed
    copy [E, K, N] scaled by ``col_scale`` [E, K]), each None where not asked for."""
    experts, n, k = w.shape
    q = torch.empty(experts, n, k, dtype=dtype, device=w.device) if write_rows else None
    qt = torch.empty(experts, k, n, dtype=dtype, device=w.device) if write_transposed else None
    spare = torch.empty(1, dtype=dtype, device=w.device)  # stands for a copy not written
    mantissa, min_exponent = GRID[dtype]
    in_mantissa, in_min_exponent = GRID.get(w.dtype, (0, 0))
    _launch(
        _cast_kernel, _cast_tuned, w, spare if q is None else q, spare if qt is None else qt, row_scale.float().contiguous(),
        col_scale.float().contiguous(), n, k, torch.finfo(dtype).max, WRITE_ROWS=write_rows, WRITE_TRANSPOSED=write_transposed,
        ROUND_FIRST=interpreted(), MANTISSA=mantissa, MIN_EXPONENT=min_exponent,
        IN_MANTISSA=in_mantissa, IN_MIN_EXPONENT=in_min_exponent,
    )  # fmt: skip
    return q, qt


def cast_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] contiguous -> (FP8 copy, inverse scales [M] fp32), one power-of-two scale per row."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=dtype, device=x.device)
    inv = torch.empty(rows, dtype=torch.float32, device=x.device)
    mantissa, min_exponent = GRID[dtype]
    in_mantissa, in_min_exponent = GRID.get(x.dtype, (0, 0))
    in_interpreter = interpreted()
    args = (x, q, inv, rows, k, torch.finfo(dtype).max)
    meta = dict(ROUND_FIRST=in_interpreter, MANTISSA=mantissa, MIN_EXPONENT=min_exponent, IN_MANTISSA=in_mantissa,
                IN_MIN_EXPONENT=in_min_exponent)  # fmt: skip
    if in_interpreter:
        _rows_kernel[(triton.cdiv(rows, _INTERPRETER_ROWS["BLOCK_M"]),)](*args, **meta, **_INTERPRETER_ROWS)
    else:
        _rows_tuned[lambda c: (triton.cdiv(rows, c["BLOCK_M"]),)](*args, **meta)
    return q, inv
