"""Triton kernels of the blockwise FP8 recipe (``meshtron.kernels.fp8_blockwise``): the cast that
writes an operand's FP8 copies with their block scales, and the GEMM that applies the scales per
128-wide slice of the reduction. Imported only when a kernel runs.

- ``_block_cast_kernel``: one program per 128 x 128 tile of a 2-D tensor, read once. A weight
  (``TILE``) gets one scale for the tile and writes the same values row-major and transposed; an
  activation or gradient gets a scale per row of the tile (its 1 x 128 blocks, for the row-major
  copy) and a scale per column (the 1 x 128 blocks of the transposed copy). Scales are powers of
  two, ``fmax / amax`` with the mantissa dropped, so scaling is exact and only the FP8 rounding errs.
- ``_block_mm_kernel``: ``C = A @ B^T`` for row-major FP8 ``A`` [M, K] and ``B`` [N, K]; each
  128-wide slice of K is multiplied on the tensor cores into a fresh fp32 tile, which is scaled by
  its rows' and columns' inverse scales and added to the fp32 accumulator (DeepSeek-V3's
  promotion of each K block's partial sum). ``A``'s scales are per row ([M, K/128]); ``B``'s per
  row or per 128 rows (``B_ROWS_PER_SCALE``), any strides.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from meshtron.kernels import interpreted, platform
from meshtron.kernels.triton_fp8_cast import GRID, round_to_grid

BLOCK = 128  # the recipe's block: a scale per 1 x 128 or 128 x 128 values


@triton.jit
def _pow2_scale(amax, fmax, floor):
    """The largest power of two not above ``fmax / amax`` (``amax`` at least ``floor``)."""
    scale = tl.math.div_rn(tl.zeros_like(amax) + fmax, tl.maximum(amax, floor))
    return (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _inverse(scale):
    return tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def _to_fp8(y, fmax, out_dtype: tl.constexpr, ROUND_FIRST: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    y = tl.minimum(tl.maximum(y, -fmax), fmax)
    if ROUND_FIRST:  # the interpreter's conversions do not round to nearest-even (triton_fp8_cast)
        y = round_to_grid(y, MANTISSA, MIN_EXPONENT)
    return y.to(out_dtype, fp_downcast_rounding="rtne")


@triton.jit
def _block_cast_kernel(
    x_ptr, q_ptr, qt_ptr, inv_ptr, inv_t_ptr, rows, cols, fmax, floor,
    TILE: tl.constexpr, WRITE_ROWS: tl.constexpr, WRITE_TRANSPOSED: tl.constexpr, ROUND_FIRST: tl.constexpr,
    MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    tile_r, tile_c = tl.program_id(0), tl.program_id(1)
    r = tile_r * BLOCK + tl.arange(0, BLOCK)
    c = tile_c * BLOCK + tl.arange(0, BLOCK)
    r2, c2 = r.to(tl.int64)[:, None], c.to(tl.int64)[None, :]
    x = tl.load(x_ptr + r2 * cols + c2)
    # Through the input's dtype, as the reference rounds (exact with a power-of-two scale; a direct
    # fp32 -> FP8 store duplicated neighbours on an H100 with Triton 3.6, see triton_fp8_cast).
    a = tl.abs(x.to(tl.float32))
    out_dtype = q_ptr.dtype.element_ty  # the copy not written is a spare of the same dtype
    if TILE:  # one scale for the tile: the same FP8 values in both layouts
        scale = _pow2_scale(tl.max(tl.max(a, 1), 0), fmax, floor)
        y = (x.to(tl.float32) * scale).to(x.dtype).to(tl.float32)
        if WRITE_ROWS:
            tl.store(q_ptr + r2 * cols + c2, _to_fp8(y, fmax, out_dtype, ROUND_FIRST, MANTISSA, MIN_EXPONENT))
            tl.store(inv_ptr + tile_r * (cols // BLOCK) + tile_c, _inverse(scale))
        if WRITE_TRANSPOSED:  # transposed in fp32, then cast, as triton_fp8_cast does (no layout change of FP8 values)
            qt = _to_fp8(tl.trans(y), fmax, out_dtype, ROUND_FIRST, MANTISSA, MIN_EXPONENT)
            tl.store(qt_ptr + tl.trans(c2 * rows + r2), qt)
            tl.store(inv_t_ptr + tile_c * (rows // BLOCK) + tile_r, _inverse(scale))
    else:
        if WRITE_ROWS:  # a scale per row of the tile; stored [cols / 128, rows] (outer-dim-major)
            scale = _pow2_scale(tl.max(a, 1), fmax, floor)
            y = (x.to(tl.float32) * scale[:, None]).to(x.dtype).to(tl.float32)
            tl.store(q_ptr + r2 * cols + c2, _to_fp8(y, fmax, out_dtype, ROUND_FIRST, MANTISSA, MIN_EXPONENT))
            tl.store(inv_ptr + tile_c * rows + r, _inverse(scale))
        if WRITE_TRANSPOSED:  # a scale per column; the transposed copy's scales stored [rows / 128, cols]
            scale = _pow2_scale(tl.max(a, 0), fmax, floor)
            y = (x.to(tl.float32) * scale[None, :]).to(x.dtype).to(tl.float32)
            qt = _to_fp8(tl.trans(y), fmax, out_dtype, ROUND_FIRST, MANTISSA, MIN_EXPONENT)
            tl.store(qt_ptr + tl.trans(c2 * rows + r2), qt)
            tl.store(inv_t_ptr + tile_r * cols + c, _inverse(scale))


def block_cast(x: torch.Tensor, dtype: torch.dtype, tile: bool, write_rows: bool, write_transposed: bool,
               floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [rows, cols] contiguous, both multiples of 128 -> (FP8 copy, its inverse scales, FP8
    transpose, its inverse scales), empty where not asked. Inverse scales: ``tile``: [rows/128,
    cols/128] and its transpose, row-major; else [cols/128, rows] and [rows/128, cols] (the
    transposes of the [rows, cols/128] and [cols, rows/128] the GEMMs index)."""
    rows, cols = x.shape
    blocks_r, blocks_c = rows // BLOCK, cols // BLOCK
    empty = lambda: torch.empty(0, dtype=dtype, device=x.device)  # noqa: E731
    scales = lambda *shape: torch.empty(shape, dtype=torch.float32, device=x.device)  # noqa: E731
    q = torch.empty(rows, cols, dtype=dtype, device=x.device) if write_rows else empty()
    qt = torch.empty(cols, rows, dtype=dtype, device=x.device) if write_transposed else empty()
    inv = (scales(blocks_r, blocks_c) if tile else scales(blocks_c, rows)) if write_rows else scales(0)
    inv_t = (scales(blocks_c, blocks_r) if tile else scales(blocks_r, cols)) if write_transposed else scales(0)
    mantissa, min_exponent = GRID[dtype]
    spare = torch.empty(1, dtype=dtype, device=x.device)  # stands for a copy not written
    _block_cast_kernel[(blocks_r, blocks_c)](
        x, q if write_rows else spare, qt if write_transposed else spare, inv, inv_t, rows, cols,
        torch.finfo(dtype).max, floor, TILE=tile, WRITE_ROWS=write_rows, WRITE_TRANSPOSED=write_transposed,
        ROUND_FIRST=interpreted(), MANTISSA=mantissa, MIN_EXPONENT=min_exponent, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
    return q, inv, qt, inv_t


@triton.jit
def _block_mm_kernel(
    a_ptr, b_ptr, c_ptr, a_inv_ptr, b_inv_ptr, M, N, K, a_inv_m, a_inv_k, b_inv_n, b_inv_k,
    B_ROWS_PER_SCALE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)  # GROUP_M row tiles side by side share B's tiles in L2
    first_m = group * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    b_ptrs = b_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    a_inv_ptrs = a_inv_ptr + rm * a_inv_m
    b_inv_ptrs = b_inv_ptr + (rn // B_ROWS_PER_SCALE) * b_inv_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(K // BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
        if UPCAST:  # the interpreter multiplies no FP8
            a, b = a.to(tl.float32), b.to(tl.float32)
        part = tl.dot(a, tl.trans(b))
        a_inv = tl.load(a_inv_ptrs + kb * a_inv_k, mask=m_ok, other=0.0)
        b_inv = tl.load(b_inv_ptrs + kb * b_inv_k, mask=n_ok, other=0.0)
        acc += part * a_inv[:, None] * b_inv[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# (BLOCK_M, BLOCK_N, warps, stages): Hopper's 227 KiB of shared memory takes the deep ones, AMD's
# 64 KiB of LDS (gfx942) the shallow ones; ``_fitting`` keeps those of the launching device.
_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": BLOCK, "GROUP_M": 8}, num_warps=w, num_stages=s)
    for bm, bn, w, s in [(128, 128, 8, 4), (128, 256, 8, 3), (128, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 2), (64, 64, 4, 2)]
]  # fmt: skip
_INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": BLOCK, "GROUP_M": 2}


def _fitting(configs: list, named_args: dict, **kwargs) -> list:
    """The tiles whose pipelined operand buffers (FP8, one byte a value) fit the device's shared memory."""
    device = next(v.device for v in named_args.values() if isinstance(v, torch.Tensor))
    shared = platform.target(device).shared_bytes
    fit = [c for c in configs if c.num_stages * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * BLOCK <= shared]
    return fit or configs[-1:]


_block_mm_tuned = triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "B_ROWS_PER_SCALE"],
                                  prune_configs_by={"early_config_prune": _fitting})(_block_mm_kernel)  # fmt: skip


def block_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)^T`` for row-major FP8 ``a`` [M, K] and ``b`` [N, K] (K a multiple
    of 128); ``a_inv`` [M, K/128], ``b_inv`` [N, K/128] or [N/128, K/128], any strides."""
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    args = (a, b, out, a_inv, b_inv, m, n, k, *a_inv.stride(), *b_inv.stride())
    rows_per_scale = 1 if b_inv.shape[0] == n else BLOCK
    if interpreted():
        grid = (triton.cdiv(m, _INTERPRETER_CONFIG["BLOCK_M"]) * triton.cdiv(n, _INTERPRETER_CONFIG["BLOCK_N"]),)
        _block_mm_kernel[grid](*args, B_ROWS_PER_SCALE=rows_per_scale, UPCAST=True, **_INTERPRETER_CONFIG)
    else:
        grid = lambda c: (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)  # noqa: E731
        _block_mm_tuned[grid](*args, B_ROWS_PER_SCALE=rows_per_scale, UPCAST=False)
    return out
