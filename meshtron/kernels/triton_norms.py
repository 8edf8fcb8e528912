"""Triton kernels for RMSNorm and LayerNorm, forward and backward, one row per program.

One kernel pair serves both norms (``RMS`` picks which): LayerNorm only adds the mean and the
bias. Statistics are computed in fp32; the forward pass saves the input in its own dtype and one
fp32 inverse standard deviation (and mean) per row, instead of the fp32 copies autograd keeps
for the unfused ops. Imported only when a kernel runs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_forward_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps, RMS: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if not RMS:
        mean = tl.sum(x, 0) / n_cols
        x = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = x * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if not RMS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_backward_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, dw_part_ptr, db_part_ptr, n_rows, n_cols, rows_per_program,
    RMS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dx for a run of rows, and this program's partial sums of dw (and db) over them."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = first + i
        # The last program's run may pass the end; masked rows load zeros, which add nothing.
        in_row = mask & ((cols * 0 + row) < n_rows)
        x = tl.load(x_ptr + row * n_cols + cols, mask=in_row, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < n_rows, other=0.0)
        if not RMS:
            x = tl.where(in_row, x - tl.load(mean_ptr + row, mask=row < n_rows, other=0.0), 0.0)
        x_hat = x * rstd
        wdy = w * dy
        c1 = tl.sum(x_hat * wdy, 0) / n_cols
        if RMS:
            dx = (wdy - x_hat * c1) * rstd
        else:
            c2 = tl.sum(wdy, 0) / n_cols
            dx = (wdy - x_hat * c1 - c2) * rstd
            db += dy
        dw += dy * x_hat
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)
    tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=mask)
    if not RMS:
        tl.store(db_part_ptr + pid * n_cols + cols, db, mask=mask)


def _block(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    return block, min(16, max(1, block // 256))


def norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """x [rows, cols] contiguous -> (y, mean or None, rstd); RMSNorm when ``bias`` is None."""
    rows, cols = x.shape
    rms = bias is None
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    mean = None if rms else torch.empty_like(rstd)
    block, warps = _block(cols)
    _norm_forward_kernel[(rows,)](
        x, weight, weight if rms else bias, y, rstd if rms else mean, rstd, cols, eps, RMS=rms, BLOCK=block, num_warps=warps
    )  # fmt: skip
    return y, mean, rstd


def norm_backward(x, weight, mean, rstd, dy, rms: bool):
    """(dx, dw, db or None) for ``norm_forward``'s saved tensors; dw/db summed in fp32."""
    rows, cols = x.shape
    programs = min(rows, 4 * _multiprocessors(x.device))
    per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, per_program)
    dx = torch.empty_like(x)
    dw_part = torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    db_part = None if rms else torch.empty_like(dw_part)
    block, warps = _block(cols)
    _norm_backward_kernel[(programs,)](
        x, weight, dy, dx, rstd if rms else mean, rstd, dw_part, dw_part if rms else db_part, rows, cols, per_program,
        RMS=rms, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    dw = dw_part.sum(0).to(weight.dtype)
    db = None if rms else db_part.sum(0).to(weight.dtype)
    return dx, dw, db


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Cached: the properties query costs ~40 µs a call, once per norm backward."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: any count is correct
