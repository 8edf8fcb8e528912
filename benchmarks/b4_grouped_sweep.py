"""Tile sweep for the Triton grouped GEMM at B4's shapes: which tiles each of its three GEMMs wants.

    python benchmarks/b4_grouped_sweep.py [--rows 49152] [--top 5] [--gemms "wgrad fp32,wgrad fp32 +="]

For fc1 (2048 -> 2 x 1408) and fc2 (1408 -> 2048) of DeepSeek-V2-Lite's 64 experts, times the
forward (rows x W^T), the input gradient (rows x W) and the weight gradient (dy^T x per group;
in bf16, and written or added into an fp32 ``main_grad`` as gradient-accumulation fusion does)
with every candidate tile, each against ``torch.mm`` of the same FLOPs, and prints the best tiles
per GEMM. The autotune lists in ``meshtron/kernels/triton_grouped_gemm.py`` come from its output.
"""

from __future__ import annotations

import argparse

import torch
import triton
from b4_grouped_gemm import EXPERTS, LAYERS, ragged_sizes, time_ms

from meshtron.kernels.triton_grouped_gemm import _rows_kernel, _weight_grad_kernel, group_offsets

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=49152)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--gemms", default="", help="comma-separated subset, e.g. 'wgrad fp32,wgrad fp32 +='")
    args = parser.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    offsets = group_offsets(ragged_sizes(args.rows, EXPERTS).to(dev))
    print(f"{torch.cuda.get_device_name()}: {EXPERTS} experts, {args.rows} rows, bf16; ms per GEMM, fraction of torch.mm")
    for layer, (k, n) in LAYERS.items():
        x = torch.randn(args.rows, k, device=dev, dtype=dt)
        dy = torch.randn(args.rows, n, device=dev, dtype=dt)
        weight = torch.randn(EXPERTS, n, k, device=dev, dtype=dt) * k**-0.5
        main_grad = torch.zeros(EXPERTS, n, k, device=dev, dtype=torch.float32)
        dense = time_ms(lambda: x @ weight[0].t(), 5, 20)  # every one of the three has rows * n * k multiply-adds
        gemms = {
            "forward": (ROW_TILES, lambda t: rows_launch(x, weight.transpose(1, 2), torch.empty_like(dy), offsets, t)),
            "input grad": (ROW_TILES, lambda t: rows_launch(dy, weight, torch.empty_like(x), offsets, t)),
            "weight grad": (WEIGHT_GRAD_TILES, lambda t: weight_grad_launch(dy, x, torch.empty_like(weight), offsets, t)),
            # Gradient-accumulation fusion: written into, or added to, an fp32 main_grad.
            "wgrad fp32": (WEIGHT_GRAD_TILES, lambda t: weight_grad_launch(dy, x, main_grad, offsets, t)),
            "wgrad fp32 +=": (WEIGHT_GRAD_TILES, lambda t: weight_grad_launch(dy, x, main_grad, offsets, t, accumulate=True)),
        }
        for gemm, (tiles, make) in gemms.items():
            if args.gemms and gemm not in args.gemms.split(","):
                continue
            timed = []
            for tile in tiles:
                try:
                    timed.append((time_ms(make(tile), 3, 15), tile))
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit the shared memory
                    print(f"  {layer} {gemm} {tile}: {type(exc).__name__}")
            timed.sort()
            best = ", ".join(f"{tile} {ms:.3f} ms ({dense / ms:.0%})" for ms, tile in timed[: args.top])
            print(f"{layer} {gemm:<13} dense {dense:.3f} ms | best: {best}")


if __name__ == "__main__":
    main()
