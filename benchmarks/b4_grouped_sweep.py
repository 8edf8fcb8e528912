"""Tile sweep for the Triton grouped GEMM at B4's shapes: which tiles each of its three GEMMs wants.

    python benchmarks/b4_grouped_sweep.py [--rows 49152] [--top 5] [--gemms "wgrad fp32,wgrad fp32 +="] [--candidates]

For fc1 (2048 -> 2 x 1408) and fc2 (1408 -> 2048) of DeepSeek-V2-Lite's 64 experts, times the
forward (rows x W^T), the input gradient (rows x W) and the weight gradient (dy^T x per group;
in bf16, and written or added into an fp32 ``main_grad`` as gradient-accumulation fusion does)
with every candidate tile, each against ``torch.mm`` of the same FLOPs, and prints the best tiles
per GEMM. The autotune lists in ``meshtron/kernels/triton_grouped_gemm.py`` come from its output.

``--candidates`` also runs the library's persistent TMA row kernel (forward and input gradient, on
Hopper) with each of ``TMA_ROW_TILES``, each first checked against the per-expert products in fp32.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
from b4_grouped_gemm import EXPERTS, LAYERS, ragged_sizes, time_ms

from meshtron.kernels import platform
from meshtron.kernels.triton_grouped_gemm import _rows_kernel, _weight_grad_kernel, group_offsets, rows_times_group_tma, tile_configs

ROW_TILES = [(bm, bn, bk, w, s) for bm, bn, bk, w, s in [
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3),
    (128, 128, 64, 4, 4), (128, 128, 128, 8, 3), (128, 256, 32, 8, 4), (64, 256, 64, 4, 4), (64, 256, 64, 8, 4),
    (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 32, 4, 5), (256, 128, 64, 8, 3), (128, 256, 64, 8, 5),
    (64, 128, 128, 4, 3), (128, 192, 64, 8, 3), (64, 256, 128, 8, 3),
]]  # fmt: skip
WEIGHT_GRAD_TILES = [
    (64, 128, 128, 8, 3), (64, 128, 128, 4, 4), (32, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 256, 128, 8, 3),
    (64, 128, 128, 8, 4), (32, 256, 128, 8, 4), (64, 256, 64, 8, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (32, 128, 256, 8, 3), (64, 128, 256, 8, 3),
    (32, 256, 128, 8, 3), (64, 256, 128, 8, 4), (32, 256, 256, 8, 3), (64, 256, 256, 8, 2), (32, 128, 128, 8, 5),
    (64, 128, 128, 8, 5), (128, 256, 128, 8, 2), (32, 64, 256, 4, 4),
]  # fmt: skip

# TMA kernel tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, flatten the tile loop, store in two
# halves), one persistent program per SM.
TMA_ROW_TILES = [
    (128, 256, 64, 8, 3, True, False), (128, 256, 64, 8, 3, False, False), (128, 128, 64, 8, 4, True, False),
    (128, 256, 64, 8, 4, True, True), (128, 256, 64, 8, 4, False, True), (128, 256, 64, 8, 3, True, True),
]  # fmt: skip


def rows_launch(a, b, out, offsets, tile):
    bm, bn, bk, w, s = tile
    n, k = out.shape[1], a.shape[1]
    grid = ((triton.cdiv(a.shape[0], bm) + EXPERTS) * triton.cdiv(n, bn),)
    return lambda: _rows_kernel[grid](a, b, out, offsets, n, k, a.stride(0), a.stride(1), *b.stride(), out.stride(0), out.stride(1),
                                      E=EXPERTS, BLOCK_E=triton.next_power_of_2(EXPERTS), IEEE=False,
                                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)  # fmt: skip


def weight_grad_launch(dy, x, dw, offsets, tile, accumulate=False):
    bm, bn, bk, w, s = tile
    n, k = dy.shape[1], x.shape[1]
    grid = (EXPERTS * triton.cdiv(n, bn) * triton.cdiv(k, bk),)
    return lambda: _weight_grad_kernel[grid](dy, x, dw, offsets, n, k, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), *dw.stride(),
                                             IEEE=False, ACCUMULATE=accumulate, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)  # fmt: skip


def as_tiles(configs) -> list[tuple[int, int, int, int, int]]:
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) for c in configs]


def tma_meta(tile) -> dict:
    """The TMA row kernel's fixed launch meta from a tile of ``TMA_ROW_TILES``."""
    bm, bn, bk, w, s, flatten, split = tile
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s, FLATTEN=flatten, SPLIT_STORE=split)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).abs().max() / expected.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=49152)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--gemms", default="", help="comma-separated subset, e.g. 'wgrad fp32,wgrad fp32 +='")
    parser.add_argument("--candidates", action="store_true", help="also the TMA row kernel's candidate tiles")
    parser.add_argument("--library-tiles", choices=["all", "autotune"], default="all",
                        help="the library kernels' tiles: this file's whole lists, or only the library's autotune lists for this GPU")
    args = parser.parse_args()
    row_tiles, weight_grad_tiles = ROW_TILES, WEIGHT_GRAD_TILES
    if args.library_tiles == "autotune":
        family = platform.target().tiles
        row_tiles, weight_grad_tiles = as_tiles(tile_configs("rows", family, False)), as_tiles(tile_configs("weight_grad", family, False))
    dev, dt = torch.device("cuda"), torch.bfloat16
    sizes = ragged_sizes(args.rows, EXPERTS)
    offsets = group_offsets(sizes.to(dev))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {EXPERTS} experts, {args.rows} rows, bf16; ms per GEMM, fraction of torch.mm")
    for layer, (k, n) in LAYERS.items():
        x = torch.randn(args.rows, k, device=dev, dtype=dt)
        dy = torch.randn(args.rows, n, device=dev, dtype=dt)
        weight = torch.randn(EXPERTS, n, k, device=dev, dtype=dt) * k**-0.5
        main_grad = torch.zeros(EXPERTS, n, k, device=dev, dtype=torch.float32)
        dense = time_ms(lambda: x @ weight[0].t(), 5, 20)  # every one of the three has rows * n * k multiply-adds
        gemms = {
            "forward": (row_tiles, lambda t: rows_launch(x, weight.transpose(1, 2), torch.empty_like(dy), offsets, t)),
            "input grad": (row_tiles, lambda t: rows_launch(dy, weight, torch.empty_like(x), offsets, t)),
            "weight grad": (weight_grad_tiles, lambda t: weight_grad_launch(dy, x, torch.empty_like(weight), offsets, t)),
            # Gradient-accumulation fusion: written into, or added to, an fp32 main_grad.
            "wgrad fp32": (weight_grad_tiles, lambda t: weight_grad_launch(dy, x, main_grad, offsets, t)),
            "wgrad fp32 +=": (weight_grad_tiles, lambda t: weight_grad_launch(dy, x, main_grad, offsets, t, accumulate=True)),
        }
        ends = offsets[1:]
        # torch._grouped_mm (the default backend's forward and input gradient) for scale, with the
        # weight as stored ([E, N, K]) and transposed into the other memory order (does it care?)
        weight_kn = weight.transpose(1, 2).contiguous()
        peers = {
            "forward": {"W stored": lambda: torch._grouped_mm(x, weight.transpose(1, 2), offs=ends),
                        "W [E, K, N] copy": lambda: torch._grouped_mm(x, weight_kn, offs=ends)},
            "input grad": {"W stored": lambda: torch._grouped_mm(dy, weight, offs=ends),
                           "W [E, K, N] copy": lambda: torch._grouped_mm(dy, weight_kn.transpose(1, 2), offs=ends)},
            "weight grad": {"dy^T x": lambda: torch._grouped_mm(dy.t(), x, offs=ends)},
        }
        candidates = tma_candidates(x, dy, weight, offsets, sizes, sms) if args.candidates else {}
        for gemm, (tiles, make) in gemms.items():
            if args.gemms and gemm not in args.gemms.split(","):
                continue
            if gemm in candidates:
                time_candidates(layer, gemm, candidates[gemm], dense, args.top)
            timed = []
            for tile in tiles:
                try:
                    timed.append((time_ms(make(tile), 3, 15), tile))
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit the shared memory
                    print(f"  {layer} {gemm} {tile}: {type(exc).__name__}")
            timed.sort()
            best = ", ".join(f"{tile} {ms:.3f} ms ({dense / ms:.0%})" for ms, tile in timed[: args.top])
            print(f"{layer} {gemm:<13} dense {dense:.3f} ms | best: {best}")
            for label, peer in peers.get(gemm, {}).items():
                try:
                    ms = time_ms(peer, 3, 15)
                    print(f"{layer} {gemm:<13} torch._grouped_mm ({label}) {ms:.3f} ms ({dense / ms:.0%})")
                except (RuntimeError, AttributeError) as exc:
                    print(f"{layer} {gemm:<13} torch._grouped_mm ({label}): {type(exc).__name__}: {str(exc)[:200]}")


def tma_candidates(x, dy, weight, offsets, sizes, sms) -> dict:
    """GEMM -> (tiles, launch(meta) of the TMA row kernel with a fixed tile, its fp32 reference)."""
    groups = torch.split(torch.arange(x.shape[0], device=x.device), sizes.tolist())
    x32, dy32, w32 = x.float(), dy.float(), weight.float()

    def rows(a, b):
        return lambda meta: rows_times_group_tma(a, b, offsets, sms, meta)

    return {
        "forward": (TMA_ROW_TILES, rows(x, weight.transpose(1, 2)), torch.cat([x32[r] @ w32[g].t() for g, r in enumerate(groups)])),
        "input grad": (TMA_ROW_TILES, rows(dy, weight), torch.cat([dy32[r] @ w32[g] for g, r in enumerate(groups)])),
    }


def time_candidates(layer, gemm, candidate, dense, top) -> None:
    """Check each TMA tile against the fp32 reference, then time it; print the best."""
    tiles, kernel, reference = candidate
    timed = []
    for tile in tiles:
        launch = functools.partial(kernel, tma_meta(tile))
        try:
            error = relative_error(launch(), reference)
            if error > 1e-2:
                print(f"  {layer} {gemm} TMA {tile}: WRONG, relative error {error:.1e}; not timed")
                continue
            timed.append((time_ms(launch, 3, 15), tile, error))
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit, or does not compile
            print(f"  {layer} {gemm} TMA {tile}: {type(exc).__name__}: {str(exc)[:200]}")
    timed.sort()
    best = ", ".join(f"{tile} {ms:.3f} ms ({dense / ms:.0%}, error {err:.1e})" for ms, tile, err in timed[:top])
    print(f"{layer} {gemm:<13} TMA tiles | best: {best}")


if __name__ == "__main__":
    main()
