"""Blockwise FP8 scaling (``--fp8-recipe blockwise``): DeepSeek-V3's training recipe, as
Transformer Engine's ``Float8BlockScaling`` and Megatron-Core's ``--fp8-recipe blockwise`` define it.

Every operand e4m3, with fp32 scales per block of 128 along the GEMM's reduction dimension:
activations and output gradients one per 1 x 128 block (a row's run of 128 values), weights one
per 128 x 128 tile. Scales are powers of two (Transformer Engine's default): ``fmax / amax`` with
its mantissa dropped, so scaling and unscaling are exact and only the FP8 rounding errs. The
three GEMMs of a linear ``y = x w^T`` (x [M, K], w [N, K], g = dL/dy [M, N]):

- forward ``y = x @ w^T``: x 1 x 128 along K, w 128 x 128;
- input gradient ``g @ w``: g 1 x 128 along N, w's transposed copy 128 x 128 (the same tiles);
- weight gradient ``g^T @ x``: g^T and x^T each 1 x 128 along M (the tokens).

A 1 x 128 operand's transposed copy has other blocks, hence other scales, so activations and
gradients are cast twice from one read; a weight's transposed copy is the same bytes transposed.
Nothing is kept between calls (no amax history): recompute and checkpoints need nothing.

Layout of a copy ``q`` [n, k] (row-major) and its inverse scales: 1 x 128 -> [n, k/128], the
transpose of a contiguous [k/128, n] (``_scaled_mm``'s "outer-dim-major"); 128 x 128 ->
[n/128, k/128] row-major. Every dimension must be a multiple of 128 (the linear runs bf16 otherwise).

GEMMs: ``torch._scaled_mm`` for bf16 outputs where cuBLAS has blockwise scaling
(``platform.blockwise_scaled_mm``: NVIDIA Hopper, CUDA 12.9+) and a first small GEMM agrees with the
reference, else the Triton kernel of ``triton_fp8_blockwise`` on GPUs, else the reference below: the operands dequantized to fp32 and multiplied (the CPU path; slow, for
correctness only). The cast: the Triton kernel on GPUs, the reference in torch ops elsewhere.
"""

from __future__ import annotations

import functools
import warnings

import torch

from meshtron.kernels import opaque_op, platform, use_triton
from meshtron.kernels.fp8_cast import AMAX_FLOOR, Quantized, cast_reference

BLOCK = 128


def pow2_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The largest power of two not above ``fmax / amax`` (fp32; an all-zero block gets a finite one)."""
    scale = fmax / amax.float().clamp(min=AMAX_FLOOR)
    return (scale.view(torch.int32) & 0x7F800000).view(torch.float32)


def _expand(per_block: torch.Tensor, rows_per_scale: int) -> torch.Tensor:
    """Block values [n or n/128, k/128] spread over the [n, k] elements they cover."""
    return per_block.repeat_interleave(rows_per_scale, 0).repeat_interleave(BLOCK, 1)


def dequantize(q: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``q`` [n, k] times its inverse block scales (either layout), in fp32."""
    return q.float() * _expand(inv, q.shape[0] // inv.shape[0])


def block_cast_reference(t: torch.Tensor, dtype: torch.dtype, tile: bool, rows: bool, transposed: bool) -> Quantized:
    """The cast in torch ops: ``t`` [n, k] scaled per 128 x 128 tile (``tile``) or per 1 x 128
    block of each copy, each copy rounded as ``fp8_cast`` rounds."""
    n, k = t.shape
    fmax, a = torch.finfo(dtype).max, t.float().abs()
    if tile:
        scale = pow2_scale(a.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK).amax((1, 3)), fmax)  # [n/128, k/128]
        cast = cast_reference(t, _expand(scale, BLOCK), dtype, rows, transposed, False)
        inv = scale.reciprocal()
        return Quantized(cast.rows, inv if rows else None, cast.transposed, inv.t().contiguous() if transposed else None)
    q = q_inv = qt = qt_inv = None
    if rows:  # a scale per row and 128 columns
        scale = pow2_scale(a.view(n, k // BLOCK, BLOCK).amax(2), fmax)  # [n, k/128]
        q = cast_reference(t, _expand(scale, 1), dtype, True, False, False).rows
        q_inv = scale.reciprocal().t().contiguous().t()
    if transposed:  # a scale per column and 128 rows: the transposed copy's 1 x 128 blocks
        scale = pow2_scale(a.t().reshape(k, n // BLOCK, BLOCK).amax(2), fmax)  # [k, n/128]
        qt = cast_reference(t, _expand(scale, 1).t(), dtype, False, True, False).transposed
        qt_inv = scale.reciprocal().t().contiguous().t()
    return Quantized(q, q_inv, qt, qt_inv)


@opaque_op("meshtron::fp8_block_cast")
def _block_cast_op(t: torch.Tensor, dtype: torch.dtype, tile: bool, rows: bool, transposed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    from meshtron.kernels import triton_fp8_blockwise

    return triton_fp8_blockwise.block_cast(t.contiguous(), dtype, tile, rows, transposed, AMAX_FLOOR)


@_block_cast_op.register_fake
def _block_cast_shapes(t, dtype, tile, rows, transposed):
    n, k = t.shape
    scales = lambda *shape: t.new_empty(shape if all(shape) else (0,), dtype=torch.float32)  # noqa: E731
    q = t.new_empty((n, k) if rows else (0,), dtype=dtype)
    qt = t.new_empty((k, n) if transposed else (0,), dtype=dtype)
    inv = scales(n // BLOCK, k // BLOCK) if tile else scales(k // BLOCK, n)
    inv_t = scales(k // BLOCK, n // BLOCK) if tile else scales(n // BLOCK, k)
    return q, inv if rows else scales(0), qt, inv_t if transposed else scales(0)


def block_cast(t: torch.Tensor, dtype: torch.dtype, tile: bool, rows: bool = True, transposed: bool = False,
               fused_kernels: str = "auto") -> Quantized:  # fmt: skip
    """``t`` [n, k] (multiples of 128) cast to ``dtype`` with 128 x 128 (``tile``) or 1 x 128 block
    scales: the copies asked for and their inverse scales, in the layouts of the module's docstring."""
    if not use_triton(fused_kernels, t):
        return block_cast_reference(t, dtype, tile, rows, transposed)
    q, inv, qt, inv_t = _block_cast_op(t, dtype, tile, rows, transposed)
    if not tile:  # the kernel writes the transposes of the layouts the GEMMs index
        inv, inv_t = inv.t(), inv_t.t()
    return Quantized(q if rows else None, inv if rows else None, qt if transposed else None, inv_t if transposed else None)


def block_mm_reference(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM of dequantized operands in fp32 (slow: the CPU path, and GPUs without Triton)."""
    return (dequantize(a, a_inv) @ dequantize(b, b_inv).t()).to(out_dtype)


def _scaled_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's blockwise GEMM: the second operand column-major (``b.t()``), its scales transposed
    with it ([K/128, N] contiguous for 1 x 128, [K/128, N/128] with unit row stride for 128 x 128)."""
    return torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv.t(), out_dtype=out_dtype)


@functools.cache
def scaled_mm_takes_blocks(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this PyTorch build's ``_scaled_mm`` runs both block layouts of the recipe on
    ``device`` and agrees with the reference: asked once per device on a small GEMM, so that a
    build whose layout rules differ from ours takes the Triton GEMM (with a warning) instead of failing."""
    gen = torch.Generator(device=device).manual_seed(0)
    x, w = (block_cast(torch.randn(256, 512, device=device, generator=gen), dtype, tile, fused_kernels="off") for tile in (False, True))
    try:
        for b in (w, x):  # 128 x 128 and 1 x 128 second operands
            got = _scaled_mm(x.rows, x.rows_inv, b.rows, b.rows_inv, torch.bfloat16).float()
            want = block_mm_reference(x.rows, x.rows_inv, b.rows, b.rows_inv, torch.float32)
            if not (got - want).norm() <= 1e-2 * want.norm():  # bf16's rounding is 0.4 % at most
                raise RuntimeError(f"relative error {((got - want).norm() / want.norm()).item():.1e} against the reference")
    except RuntimeError as error:
        warnings.warn(f"torch._scaled_mm with block scales failed its check ({error}); the blockwise FP8 recipe runs its Triton GEMM")
        return False
    return True


def gemm_backend(a: torch.Tensor, out_dtype: torch.dtype, fused_kernels: str = "auto") -> str:
    """Which GEMM ``block_mm`` runs for FP8 ``a`` [M, K]: ``scaled_mm`` (cuBLAS: a bf16 output, the
    only one its block-scaled kernels write, where it has them and they pass ``scaled_mm_takes_blocks``,
    and K/128 a multiple of 4, where every PyTorch release agrees on the weight scales' layout),
    ``triton``, or ``reference``."""
    blocks_fit = out_dtype == torch.bfloat16 and (a.shape[1] // BLOCK) % 4 == 0
    if a.is_cuda and blocks_fit and platform.blockwise_scaled_mm(a.device) and scaled_mm_takes_blocks(a.device, a.dtype):
        return "scaled_mm"
    return "triton" if use_triton(fused_kernels, a) else "reference"


@opaque_op("meshtron::fp8_block_mm")
def _block_mm_op(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype,
                 fused_kernels: str, backend: str) -> torch.Tensor:  # fmt: skip
    backend = gemm_backend(a, out_dtype, fused_kernels) if backend == "auto" else backend
    if backend == "scaled_mm":
        return _scaled_mm(a, a_inv, b, b_inv, out_dtype)
    if backend == "reference":
        return block_mm_reference(a, a_inv, b, b_inv, out_dtype)
    from meshtron.kernels import triton_fp8_blockwise

    return triton_fp8_blockwise.block_mm(a, a_inv, b, b_inv, out_dtype)


@_block_mm_op.register_fake
def _block_mm_shape(a, a_inv, b, b_inv, out_dtype, fused_kernels, backend):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def block_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype,
             fused_kernels: str = "auto", backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """``(a * a_inv) @ (b * b_inv)^T`` for row-major FP8 ``a`` [M, K] with 1 x 128 scales and
    ``b`` [N, K] with 1 x 128 or 128 x 128 scales, on ``backend`` (``auto``: ``gemm_backend``'s
    pick). One custom op, ``meshtron::fp8_block_mm``: opaque to ``torch.compile``, which so never
    traces the choice of GEMM."""
    return _block_mm_op(a, a_inv, b, b_inv, out_dtype, fused_kernels, backend)
