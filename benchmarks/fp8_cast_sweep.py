"""The FP8 cast kernel's tile, timed on a GPU at B3's operand shapes.

    python benchmarks/fp8_cast_sweep.py [--steps 50]

B3 (Llama-3-8B layers, seq 8192) casts each FP8 linear's input, weight and output gradient once a
step, each row-major and transposed with its amax (``meshtron/kernels/triton_fp8_cast.py``). This
times every candidate tile (rows, columns, warps) of that kernel, after a warm-up
pass over every shape, on each shape, checks that its
bytes and amax equal the current tile's, and prints GB/s (2 bytes read, 2 written per element)
beside a bf16 copy of the same tensor (the bandwidth a pass can reach). The step's cast time in the
FP8 profile is the sum over shapes; the best tile overall is printed last.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from b1_llama import time_steps

from meshtron.kernels.triton_fp8_cast import TILE, cast

# (rows, cols) of B3's casts per block: inputs, weights and output gradients of qkv, proj, fc1, fc2
SHAPES = {"x [8192, 4096]": (8192, 4096), "x fc2 [8192, 14336]": (8192, 14336), "w qkv [6144, 4096]": (6144, 4096),
          "w proj [4096, 4096]": (4096, 4096), "w fc1 [28672, 4096]": (28672, 4096), "w fc2 [4096, 14336]": (4096, 14336),
          "g qkv [8192, 6144]": (8192, 6144), "g fc1 [8192, 28672]": (8192, 28672)}  # fmt: skip
# how many of each shape a B3 step casts (8 blocks): x 3 per block (qkv, proj, fc1), x fc2 1, each weight 1, g proj/fc2 as x
COUNTS = {"x [8192, 4096]": 40, "x fc2 [8192, 14336]": 8, "w qkv [6144, 4096]": 8, "w proj [4096, 4096]": 8,
          "w fc1 [28672, 4096]": 8, "w fc2 [4096, 14336]": 8, "g qkv [8192, 6144]": 8, "g fc1 [8192, 28672]": 8}  # fmt: skip
CANDIDATES = [(64, 64, 4), (64, 64, 8), (64, 128, 4), (128, 64, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8),
              (32, 128, 4), (128, 32, 4), (32, 256, 8), (256, 32, 8)]  # fmt: skip


def ms(fn, warmup: int, steps: int) -> float:
    return statistics.median(time_steps(fn, warmup, steps)) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    scale = torch.tensor(3.0, device="cuda")
    totals = {tile: 0.0 for tile in CANDIDATES}
    copy_total = 0.0
    print(f"{torch.cuda.get_device_name()}: e4m3 cast, rows + transposed + amax; ms and GB/s per tile (rows, cols, warps)")
    for rows, cols in SHAPES.values():  # warm-up: clocks up, every launch compiled
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        for tile in CANDIDATES:
            ms(lambda tile=tile: cast(x, scale, torch.float8_e4m3fn, True, True, True, tile), 2, 3)
    for name, (rows, cols) in SHAPES.items():
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        gb = rows * cols * 4 / 1e9
        copy_ms = ms(lambda: x.clone(), args.warmup, args.steps)
        copy_total += COUNTS[name] * copy_ms
        want = cast(x, scale, torch.float8_e4m3fn, True, True, True, TILE)
        line = [f"{name:<22} copy {copy_ms:.3f} ms {gb / copy_ms * 1e3:6.0f} GB/s"]
        for tile in CANDIDATES:
            got = cast(x, scale, torch.float8_e4m3fn, True, True, True, tile)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[:2], want[:2]))
            same = same and torch.equal(got[2], want[2])
            t = ms(lambda tile=tile: cast(x, scale, torch.float8_e4m3fn, True, True, True, tile), args.warmup, args.steps)
            totals[tile] += COUNTS[name] * t
            line.append(f"  {tile}: {t:.3f} ms {gb / t * 1e3:6.0f} GB/s{'' if same else ' DIFFERS'}")
        print("\n".join(line), flush=True)
    print(f"\nper B3 step (counts {sum(COUNTS.values())} casts): bf16 copies of the same tensors {copy_total:.2f} ms")
    for tile, total in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"  {tile}: {total:.2f} ms{'  (current)' if tile == TILE else ''}")


if __name__ == "__main__":
    main()
