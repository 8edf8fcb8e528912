"""Candidate grouped-GEMM kernels for Hopper and later: persistent programs, operands and results
through the tensor memory accelerator (TMA). Not used by the library: ``b4_grouped_sweep.py
--candidates`` checks them against a reference and times them next to the library's kernels
(``meshtron/kernels/triton_grouped_gemm.py``) at B4's shapes; a candidate that wins moves there.

Why they might win where tile tuning did not:
- The library's weight gradient into an fp32 ``main_grad`` runs at ~58 % of a dense GEMM (written)
  and ~40 % (added): each program's fp32 tile is written (and read) after its main loop, with no
  tensor-core work beside it. Here a fixed set of programs walks the tiles, and each tile's result
  leaves through an asynchronous TMA store, so it drains while the next tile's main loop runs.
- The row kernels load through TMA instead of masked pointer loads (fewer registers and address
  computations, hardware bounds handling).

Group boundaries without masks: the weight gradient's operands are read through descriptors made
on the device for each group (``tl.make_tensor_descriptor`` based at the group's first row, its
row count as the shape), so rows past the group read as zeros. The row kernels read A through one
descriptor over all rows (rows of the next group land in output rows that are not stored) and
store through a descriptor of the group's rows, which clips the tile at the group's end.

TMA wants 16-byte aligned row strides and group starts: every width times the element size a
multiple of 16 (B4's 2048, 2816 and 1408 in bf16 are). Device-side descriptors need a scratch
allocator, which ``ensure_allocator`` installs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshtron.kernels.triton_grouped_gemm import _find_row_tile


def ensure_allocator() -> None:
    """Device-side descriptors live in a scratch buffer Triton asks the caller for."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu"))


@triton.jit
def _real_row_tiles(offsets_ptr, E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row tiles of all groups together: sum over g of ceil(size_g / BLOCK_M)."""
    e = tl.arange(0, BLOCK_E)
    sizes = tl.load(offsets_ptr + e + 1, mask=e < E, other=0) - tl.load(offsets_ptr + e, mask=e < E, other=0)
    return tl.sum((sizes + BLOCK_M - 1) // BLOCK_M, 0)


@triton.jit
def _rows_tma_kernel(
    a_ptr, w_ptr, out_ptr, offsets_ptr, R,
    N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr, TRANSPOSE_W: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[r, :N] = a[r, :K] @ op(w[g]) for every row r of group g; w is [E, N, K] with
    ``TRANSPOSE_W`` (the forward, nn.Linear's layout), else [E, K, N] (the input gradient)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    if TRANSPOSE_W:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles = _real_row_tiles(offsets_ptr, E, BLOCK_E, BLOCK_M) * n_tiles
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=FLATTEN):
        g, row_start, row_end = _find_row_tile(offsets_ptr, tile // n_tiles, E, BLOCK_E, BLOCK_M)
        n0 = (tile % n_tiles) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([row_start, k0])
            if TRANSPOSE_W:  # w[g] rows n0.. (a tile reaching into w[g + 1] feeds columns >= N, never stored)
                b = w_desc.load([g * N + n0, k0]).T
            else:  # w[g] rows k0.. (rows of w[g + 1] meet a's zero columns >= K)
                b = w_desc.load([g * K + k0, n0])
            acc = tl.dot(a, b, acc)
        group_start = tl.load(offsets_ptr + g)
        out_desc = tl.make_tensor_descriptor(out_ptr + group_start.to(tl.int64) * N, shape=[row_end - group_start, N],
                                             strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])  # fmt: skip
        out_desc.store([row_start - group_start, n0], acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _weight_grad_tma_kernel(
    dy_ptr, x_ptr, dw_ptr, offsets_ptr,
    N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, ACCUMULATE: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dW[g] (+)= dy_g^T @ x_g: dy [R, N], x [R, K], dW [E, N, K]; an empty group gets zeros."""
    n_tiles, k_tiles = tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), E * n_tiles * k_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        g = tile // (n_tiles * k_tiles)
        n0 = (tile // k_tiles % n_tiles) * BLOCK_N
        k0 = (tile % k_tiles) * BLOCK_K
        start = tl.load(offsets_ptr + g)
        rows = tl.load(offsets_ptr + g + 1) - start  # int32, like every descriptor shape and coordinate
        row_start = start.to(tl.int64)
        described = tl.maximum(rows, 1)  # a descriptor wants a nonzero shape; an empty group reads nothing
        dy_desc = tl.make_tensor_descriptor(dy_ptr + row_start * N, shape=[described, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
        x_desc = tl.make_tensor_descriptor(x_ptr + row_start * K, shape=[described, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        dw_desc = tl.make_tensor_descriptor(dw_ptr + g.to(tl.int64) * N * K, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for r0 in range(0, rows, BLOCK_M):
            acc = tl.dot(dy_desc.load([r0, n0]).T, x_desc.load([r0, k0]), acc)
        if ACCUMULATE:
            acc += dw_desc.load([n0, k0]).to(tl.float32)
        dw_desc.store([n0, k0], acc.to(dw_ptr.dtype.element_ty))


def _check_tma_widths(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous() or (t.shape[-1] * t.element_size()) % 16:
            raise ValueError(f"TMA needs contiguous rows of a multiple of 16 bytes, got {tuple(t.shape)} {t.dtype}")


def _launch_meta(tile: dict, num_programs: int) -> dict:
    meta = {k: tile[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    meta.update(NUM_PROGRAMS=num_programs, FLATTEN=tile.get("FLATTEN", False))
    if "num_warps" in tile:
        meta.update(num_warps=tile["num_warps"], num_stages=tile["num_stages"])
    return meta


def rows_times_group_tma(a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transpose_weight: bool,
                         tile: dict, num_programs: int) -> torch.Tensor:  # fmt: skip
    """a [R, K] grouped by ``offsets`` [E + 1] times weight[g]^T (``transpose_weight``, weight [E, N, K])
    or weight[g] (weight [E, K, N]) -> [R, N]."""
    experts = weight.shape[0]
    n, k = (weight.shape[1], weight.shape[2]) if transpose_weight else (weight.shape[2], weight.shape[1])
    out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    _check_tma_widths(a, weight, out)
    if a.shape[0]:
        _rows_tma_kernel[(num_programs,)](a, weight, out, offsets, a.shape[0], N=n, K=k, E=experts, BLOCK_E=triton.next_power_of_2(experts),
                                          TRANSPOSE_W=transpose_weight, **_launch_meta(tile, num_programs))  # fmt: skip
    return out


def group_weight_grad_tma(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, accumulate: bool,
                          tile: dict, num_programs: int) -> torch.Tensor:  # fmt: skip
    """dy [R, N], x [R, K] -> ``out`` [E, N, K] (any float dtype, e.g. an fp32 ``main_grad``)
    written, or added to (``accumulate``), with dW[g] = dy_g^T @ x_g."""
    _check_tma_widths(dy, x, out)
    _weight_grad_tma_kernel[(num_programs,)](dy, x, out, offsets, N=dy.shape[1], K=x.shape[1], E=out.shape[0], ACCUMULATE=accumulate,
                                             **_launch_meta(tile, num_programs))  # fmt: skip
    return out
