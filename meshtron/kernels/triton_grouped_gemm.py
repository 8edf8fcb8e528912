"""Triton grouped GEMM for the MoE experts: rows of ``x`` grouped by expert, each group times its
expert's weight, forward and backward, for variable-size and empty groups.

Why our own: ``torch._grouped_mm`` is missing or limited on some builds and GPUs (ROCm, older
CUDA cards, unaligned widths); this runs wherever Triton does.

Why no host sync: the group sizes live on the device. Every kernel finds its work from the group
offsets itself: a row-tile program takes the cumulative sum of ``ceil(size / BLOCK_M)`` over the
experts (``tl.cumsum`` on a vector of E) and looks up its group and its first row; the grid is
sized by the bound ``ceil(R / BLOCK_M) + E`` on the number of row tiles, and the programs past
the real count return at once. So the lookup needs nothing from the host and follows each
autotuned ``BLOCK_M``.

- ``_rows_kernel``: out[rows of g] = a[rows of g] @ b[g] for a [R, K] and b [E, K, N] given by
  strides. Forward uses ``b[g] = W[g]^T`` (W [E, N, K], nn.Linear layout), the input gradient
  ``b[g] = W[g]``: the same kernel with the weight's strides swapped.
- ``_weight_grad_kernel``: dW[g] = dy_g^T @ x_g, one program per (expert, N tile, K tile), the
  reduction running over the group's rows; an empty group gets zeros. With ``ACCUMULATE`` it adds
  into dW instead: gradient-accumulation fusion writes the experts' fp32 ``main_grad`` directly.

The program order puts N tiles of one row tile next to each other, so programs running at once
share an expert and its weight stays in L2. Accumulation is fp32; fp32 inputs are multiplied in
full fp32 (no TF32), like ``torch.matmul``'s default.

On Hopper and later (bf16/fp16, contiguous rows of a multiple of 16 bytes), the forward and the
input gradient run ``_rows_tma_kernel`` instead: one persistent program per SM walks the tiles,
operands arrive through the tensor memory accelerator (TMA) and each tile leaves through an
asynchronous TMA store that drains while the next tile's main loop runs. At B4's shapes on an
H100 that took the forward from 66 % of a dense GEMM's speed to 77-78 % (``torch._grouped_mm``:
76 %; benchmarks/RESULTS.md). The rows of the next group that a tile reads through the single
descriptor over ``a`` land in output rows that are never stored: the store goes through a
descriptor of the group's own rows, made on the device, which clips the tile at the group's end.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from meshtron.kernels import interpreted, platform


def _configs(tiles: list[tuple[int, int, int, int, int]]) -> list:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s) for bm, bn, bk, w, s in tiles]


# bf16/fp16 tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per tile family of ``platform.TARGETS``,
# as (rows kernel, weight-gradient kernel):
# - nvidia: on an H100 at DeepSeek-V2-Lite's expert shapes (K, N of 2048 and 2816/1408), the
#   fastest of benchmarks/b4_grouped_sweep.py's candidates;
# - cdna (gfx90a, gfx942: 64 KiB of LDS): MFMA-sized tiles (multiples of 32) of 4 or 8 wavefronts
#   of 64, two stages (one LDS buffer on AMD), each within 64 KiB for the compiled kernel;
# - cdna4 (gfx950: 160 KiB of LDS): cdna's and the larger ones that then fit.
# The AMD lists are chosen to fit, not timed (no AMD GPU here); the CI compile check
# (tests/unit/test_compile_targets.py) holds every tile to its target's memory.
_CDNA_ROWS = [(128, 128, 64, 8, 2), (128, 128, 32, 4, 2), (64, 128, 64, 4, 2), (128, 64, 64, 4, 2), (64, 64, 64, 4, 2)]
_CDNA_WEIGHT_GRAD = [(32, 128, 128, 4, 2), (64, 128, 128, 8, 2), (64, 128, 64, 4, 2), (64, 64, 128, 4, 2), (32, 64, 64, 4, 2)]
_TILES = {
    "nvidia": (_configs([(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4)]),
               _configs([(32, 256, 128, 8, 4), (32, 128, 128, 4, 4), (64, 128, 256, 8, 3), (64, 128, 128, 8, 4), (64, 64, 128, 4, 4)])),
    "cdna": (_configs(_CDNA_ROWS), _configs(_CDNA_WEIGHT_GRAD)),
    "cdna4": (_configs([(256, 256, 64, 8, 2), (128, 256, 64, 8, 2), (128, 128, 64, 8, 3)] + _CDNA_ROWS),
              _configs([(64, 256, 128, 8, 2), (64, 128, 256, 8, 2)] + _CDNA_WEIGHT_GRAD)),
}  # fmt: skip

# fp32 inputs multiply in full fp32 (FMA on NVIDIA, fp32 MFMA on AMD): small tiles, on every target.
_FP32_ROW_CONFIGS = _configs([(64, 64, 32, 4, 3), (32, 64, 32, 4, 3)])
_FP32_WEIGHT_GRAD_CONFIGS = _configs([(32, 64, 64, 4, 3), (32, 64, 32, 4, 3)])


def tile_configs(kernel: str, family: str, ieee: bool) -> list:
    """The tiles autotuning tries for ``kernel`` ("rows" or "weight_grad") on a target of tile
    ``family``: fp32 (IEEE) only the small ones, whose unrolled FMA code compiles in seconds (the
    large tiles took minutes each on an H100, most not fitting), bf16/fp16 the family's."""
    if ieee:
        return _FP32_ROW_CONFIGS if kernel == "rows" else _FP32_WEIGHT_GRAD_CONFIGS
    rows, weight_grad = _TILES[family]
    return rows if kernel == "rows" else weight_grad


def _all_configs(kernel: str) -> list:
    """Every tile of ``kernel`` over the families, once each: the autotuner's list, pruned per launch."""
    return list(dict.fromkeys(c for family in _TILES for ieee in (False, True) for c in tile_configs(kernel, family, ieee)))


# The TMA kernel's tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, flatten the tile loop, store in
# two halves): the fastest of b4_grouped_sweep.py --candidates on an H100 at the same shapes (the
# split store lets fc2's forward take 4 stages: 0.466 ms against torch._grouped_mm's 0.510).
_ROW_TMA_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "FLATTEN": flat, "SPLIT_STORE": split}, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s, flat, split in [(128, 256, 64, 8, 3, True, False), (128, 256, 64, 8, 3, True, True),
                                          (128, 256, 64, 8, 4, True, True), (128, 128, 64, 8, 4, True, False)]
]  # fmt: skip

# Fixed small tiles for Triton's interpreter (CPU tests), where autotuning cannot time anything.
_INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}


@triton.jit
def _find_row_tile(offsets_ptr, tile, E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row tile ``tile`` in the order (expert, tile within it) -> (expert, first row, end row);
    an expert past the last (``g == E``) when ``tile`` is beyond the real tiles."""
    e = tl.arange(0, BLOCK_E)
    starts = tl.load(offsets_ptr + e, mask=e < E, other=0)
    ends = tl.load(offsets_ptr + e + 1, mask=e < E, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    last_tile_end = tl.cumsum(tiles, 0)
    g = tl.sum((last_tile_end <= tile).to(tl.int32), 0)
    chosen = e == g
    first_tile = tl.sum(tl.where(chosen, last_tile_end - tiles, 0), 0)
    row_start = tl.sum(tl.where(chosen, starts, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(chosen, ends, 0), 0)
    return g, row_start, row_end


@triton.jit
def _rows_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr,
    N, K,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_om, stride_on,
    E: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[r, :] = a[r, :] @ b[g] for every row r of group g."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    g, row_start, row_end = _find_row_tile(offsets_ptr, pid // n_tiles, E, BLOCK_E, BLOCK_M)
    if g < E:
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < row_end, cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak
        b_ptrs = b_ptr + g.to(tl.int64) * stride_bg + ks[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks + k0 < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _real_row_tiles(offsets_ptr, E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row tiles of all groups together: the sum over g of ceil(size_g / BLOCK_M)."""
    e = tl.arange(0, BLOCK_E)
    sizes = tl.load(offsets_ptr + e + 1, mask=e < E, other=0) - tl.load(offsets_ptr + e, mask=e < E, other=0)
    return tl.sum((sizes + BLOCK_M - 1) // BLOCK_M, 0)


@triton.jit
def _rows_tma_kernel(
    a_ptr, w_ptr, out_ptr, offsets_ptr, R,
    N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr, TRANSPOSE_W: tl.constexpr,
    FLATTEN: tl.constexpr, SPLIT_STORE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[r, :N] = a[r, :K] @ op(w[g]) for every row r of group g, persistent over the tiles; w is
    [E, N, K] read transposed (``TRANSPOSE_W``: the forward, nn.Linear's layout), else [E, K, N]
    (the input gradient). ``SPLIT_STORE`` stores each tile in two column halves (half the staging
    memory, so one more pipeline stage fits)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    if TRANSPOSE_W:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    STORE_N: tl.constexpr = BLOCK_N // 2 if SPLIT_STORE else BLOCK_N
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles = _real_row_tiles(offsets_ptr, E, BLOCK_E, BLOCK_M) * n_tiles
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
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
                                             strides=[N, 1], block_shape=[BLOCK_M, STORE_N])  # fmt: skip
        if SPLIT_STORE:
            left, right = acc.reshape(BLOCK_M, 2, STORE_N).permute(0, 2, 1).split()
            out_desc.store([row_start - group_start, n0], left.to(out_ptr.dtype.element_ty))
            out_desc.store([row_start - group_start, n0 + STORE_N], right.to(out_ptr.dtype.element_ty))
        else:
            out_desc.store([row_start - group_start, n0], acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _weight_grad_kernel(
    dy_ptr, x_ptr, dw_ptr, offsets_ptr,
    N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_wg, stride_wn, stride_wk,
    IEEE: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dW[g, n, k] (+)= sum over rows r of group g of dy[r, n] * x[r, k]."""
    pid = tl.program_id(0)
    n_tiles, k_tiles = tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K)
    g = pid // (n_tiles * k_tiles)
    ns = (pid // k_tiles % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (pid % k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok, k_ok = ns < N, ks < K
    row_start = tl.load(offsets_ptr + g)
    row_end = tl.load(offsets_ptr + g + 1)
    rows = row_start + tl.arange(0, BLOCK_M)
    dy_ptrs = dy_ptr + rows[:, None].to(tl.int64) * stride_dym + ns[None, :] * stride_dyn
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_M):
        row_ok = rows < row_end - (r0 - row_start)
        dy = tl.load(dy_ptrs, mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(tl.trans(dy), x, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(dy), x, acc)
        dy_ptrs += BLOCK_M * stride_dym
        x_ptrs += BLOCK_M * stride_xm
    dw_ptrs = dw_ptr + g.to(tl.int64) * stride_wg + ns[:, None] * stride_wn + ks[None, :] * stride_wk
    if ACCUMULATE:
        acc += tl.load(dw_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def _pruner(kernel: str):
    """The autotuner's ``early_config_prune`` for ``kernel``: the tiles of the launching device's
    family and the inputs' precision (``tile_configs``), chosen at run time."""

    def prune(configs: list, named_args: dict, **kwargs) -> list:
        ieee = bool(named_args.get("IEEE", kwargs.get("IEEE")))
        device = next(v.device for v in named_args.values() if isinstance(v, torch.Tensor))
        allowed = tile_configs(kernel, platform.target(device).tiles, ieee)
        return [c for c in configs if c in allowed]

    return prune


_rows_tuned = triton.autotune(configs=_all_configs("rows"), key=["N", "K", "E", "IEEE"],
                              prune_configs_by={"early_config_prune": _pruner("rows")})(_rows_kernel)  # fmt: skip
_rows_tma_tuned = triton.autotune(configs=_ROW_TMA_CONFIGS, key=["N", "K", "E", "TRANSPOSE_W"])(_rows_tma_kernel)
# Autotuning times each config on the real output: restore_value keeps an accumulating dW from
# collecting every trial's product.
_weight_grad_tuned = triton.autotune(configs=_all_configs("weight_grad"), key=["N", "K", "IEEE", "ACCUMULATE"], restore_value=["dw_ptr"],
                                     prune_configs_by={"early_config_prune": _pruner("weight_grad")})(_weight_grad_kernel)  # fmt: skip


def tma_rows_usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``rows_times_group(a, b)`` can take the TMA kernel: a CUDA GPU of compute capability
    9 or later (not ROCm) with Triton's device-side descriptors, bf16 or fp16, ``a`` contiguous,
    ``b`` [E, K, N] contiguous or the transpose of a contiguous [E, N, K], every row a multiple of
    16 bytes from an aligned start (what TMA reads and writes)."""
    if not (a.is_cuda and torch.version.hip is None and hasattr(tl, "make_tensor_descriptor")):
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype or not a.is_contiguous():
        return False
    w = b if b.is_contiguous() else b.transpose(1, 2)
    aligned = all(t.shape[-1] * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, w))
    return w.is_contiguous() and aligned and _compute_capability(a.device)[0] >= 9


@functools.cache
def _compute_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def rows_times_group_tma(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, programs: int, tile: dict | None = None) -> torch.Tensor:
    """``rows_times_group`` on the persistent TMA kernel, ``programs`` of them; ``tile``: fixed
    launch meta (the interpreter's tests, the tile sweep) instead of the autotuned tiles."""
    rows, k = a.shape
    experts, _, n = b.shape
    transpose_w = not b.is_contiguous()
    w = b.transpose(1, 2) if transpose_w else b  # contiguous [E, N, K] or [E, K, N]
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    if rows == 0 or n == 0:
        return out
    triton.set_allocator(_scratch)  # device-side descriptors live in scratch memory Triton asks the caller for
    args = (a, w, out, offsets, rows)
    meta = dict(N=n, K=k, E=experts, BLOCK_E=triton.next_power_of_2(experts), TRANSPOSE_W=transpose_w)
    if tile is None:
        _rows_tma_tuned[(programs,)](*args, **meta)
    else:
        _rows_tma_kernel[(programs,)](*args, **meta, **tile)
    return out


def group_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """[E] sizes -> [E + 1] int32 offsets (0, end of group 0, ...), on the sizes' device."""
    offsets = torch.zeros(group_sizes.numel() + 1, dtype=torch.int32, device=group_sizes.device)
    torch.cumsum(group_sizes, 0, out=offsets[1:])
    return offsets


def rows_times_group(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [R, K] and b [E, K, N] (any strides) -> [R, N]: each group's rows times its b[g]."""
    if not interpreted() and tma_rows_usable(a, b):
        return rows_times_group_tma(a, b, offsets, _sm_count(a.device))
    rows, k = a.shape
    experts, _, n = b.shape
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    if rows == 0 or n == 0:
        return out
    args = (a, b, out, offsets, n, k, a.stride(0), a.stride(1), *b.stride(), out.stride(0), out.stride(1))
    meta = dict(E=experts, BLOCK_E=triton.next_power_of_2(experts), IEEE=a.dtype == torch.float32)
    if interpreted():
        grid = ((triton.cdiv(rows, 16) + experts) * triton.cdiv(n, 16),)
        _rows_kernel[grid](*args, **meta, **_INTERPRETER_CONFIG)
    else:
        grid = lambda c: ((triton.cdiv(rows, c["BLOCK_M"]) + experts) * triton.cdiv(n, c["BLOCK_N"]),)  # noqa: E731
        _rows_tuned[grid](*args, **meta)
    return out


def group_weight_grad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, experts: int,
                      out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:  # fmt: skip
    """dy [R, N], x [R, K] -> dW [E, N, K], dW[g] = dy_g^T @ x_g (zeros for an empty group), new in
    x's dtype or written (``accumulate``: added) into ``out`` (e.g. an fp32 ``main_grad``)."""
    n, k = dy.shape[1], x.shape[1]
    dw = torch.empty(experts, n, k, dtype=x.dtype, device=x.device) if out is None else out
    args = (dy, x, dw, offsets, n, k, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), *dw.stride())
    meta = dict(IEEE=x.dtype == torch.float32, ACCUMULATE=accumulate)
    if interpreted():
        grid = (experts * triton.cdiv(n, 16) * triton.cdiv(k, 16),)
        _weight_grad_kernel[grid](*args, **meta, **_INTERPRETER_CONFIG)
    else:
        grid = lambda c: (experts * triton.cdiv(n, c["BLOCK_N"]) * triton.cdiv(k, c["BLOCK_K"]),)  # noqa: E731
        _weight_grad_tuned[grid](*args, **meta)
    return dw


class TritonGroupedMM(torch.autograd.Function):
    """x [R, K] grouped by device ``offsets`` [E + 1] times weight [E, N, K] (nn.Linear layout) -> [R, N]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets)
        return rows_times_group(x, weight.transpose(1, 2), offsets)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()  # an expanded (stride-0) gradient, e.g. of out.sum()
        grad_x = rows_times_group(grad_out, weight, offsets) if ctx.needs_input_grad[0] else None
        grad_w = group_weight_grad(grad_out, x, offsets, weight.shape[0]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


# Run eagerly inside a compiled block (a graph break) rather than traced: the autotuned launches
# with grids computed from their configs are simple to run and not worth the tracing risk.
@torch.compiler.disable
def grouped_mm_triton(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """As ``grouped_mm_loop`` in ``layers/moe/grouped_gemm.py``, with the sizes never read on the host."""
    return TritonGroupedMM.apply(x, weight, group_offsets(group_sizes))
