"""The FP8 cast of a 2-D operand: its scaled FP8 copy row-major and/or transposed, and its amax.

Two paths with the same numbers: the reference in torch ops (the CPU, and GPUs without Triton),
and ``meshtron.kernels.triton_fp8_cast``'s one-pass kernel, run as the custom op
``meshtron::fp8_cast`` so that ``torch.compile`` keeps it as one opaque call instead of tracing
into Triton. Both compute ``t * scale`` in fp32, round it to ``t``'s dtype, clamp it to the
format's range (e4m3fn and the fnuz formats have no infinity) and round it to FP8; the amax is the largest ``|t|``, in
fp32. (Not ``t * scale`` in ``t``'s dtype: a 0-d CUDA scale would be rounded to bf16 before the
multiply, scaling by up to 0.4 % off the inverse scale the GEMM later applies.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from meshtron.kernels import opaque_op, use_triton


AMAX_FLOOR = 1e-12  # an all-zero tensor (or block) gets a finite scale


class Quantized(NamedTuple):
    """An operand's FP8 copies and their inverse scales (0-d, one per row of the copy: [n, 1], or
    per block: ``fp8_blockwise``), as the GEMMs read them."""

    rows: torch.Tensor | None
    rows_inv: torch.Tensor | None
    transposed: torch.Tensor | None
    transposed_inv: torch.Tensor | None


class Cast(NamedTuple):
    rows: torch.Tensor | None  # [rows, cols] FP8, when asked for
    transposed: torch.Tensor | None  # [cols, rows] FP8, when asked for
    amax: torch.Tensor | None  # fp32 0-d, when asked for


def amax_reference(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, ord=float("inf")).float()


def cast_reference(t: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, rows: bool, transposed: bool,
                   compute_amax: bool) -> Cast:  # fmt: skip
    amax = amax_reference(t) if compute_amax else None
    if not (rows or transposed):
        return Cast(None, None, amax)
    fmax = torch.finfo(dtype).max
    q = (t.float() * scale.float()).to(t.dtype).clamp_(-fmax, fmax).to(dtype)
    return Cast(q if rows else None, q.t().contiguous() if transposed else None, amax)


@opaque_op("meshtron::fp8_cast")
def _fp8_cast_op(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: bool, transposed: bool,
                 compute_amax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    from meshtron.kernels.triton_fp8_cast import cast

    return cast(t.contiguous(), scale, dtype, rows, transposed, compute_amax)


@_fp8_cast_op.register_fake
def _fp8_cast_shapes(t, scale, dtype, rows, transposed, compute_amax):
    n, m = t.shape
    return (t.new_empty((n, m) if rows else (0,), dtype=dtype), t.new_empty((m, n) if transposed else (0,), dtype=dtype),
            t.new_empty((), dtype=torch.float32))  # fmt: skip


def fp8_cast(t: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, rows: bool = True, transposed: bool = False,
             compute_amax: bool = False, fused_kernels: str = "auto") -> Cast:  # fmt: skip
    """``t`` [rows, cols] scaled by ``scale`` (0-d, [rows, 1] or [1, cols] fp32; None when only the
    amax is asked for) and cast to ``dtype``: the copies asked for, and ``amax(|t|)`` if asked."""
    if not use_triton(fused_kernels, t):
        return cast_reference(t, scale, dtype, rows, transposed, compute_amax)
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=t.device)
    q, qt, amax = _fp8_cast_op(t, scale, dtype, rows, transposed, compute_amax)
    return Cast(q if rows else None, qt if transposed else None, amax if compute_amax else None)
