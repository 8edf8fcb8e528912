"""The host's cost of one kernel launch, by launch path: what a host-bound step pays per kernel
(DeepSeek-V2-Lite's MoE block launches 106 kernels forward + backward at 4,096 tokens, about a
quarter of them Triton's; RESULTS.md, eleventh session), measured on the GPU.

    PYTHONPATH=$PWD python benchmarks/launch_overhead.py [--launches 2000]

Prints the median over rounds of host µs per launch (wall time to enqueue, no sync inside) for a
small aten op (``torch.add`` into a buffer) and a trivial Triton kernel through its JIT entry
(``kernel[grid](...)``, as our kernels launch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)


def per_launch_us(launch, launches: int, rounds: int = 7) -> float:
    """Median over rounds of the host µs per call of ``launch`` (synchronized between rounds only)."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(launches):
            launch()
        times.append((time.perf_counter() - began) / launches * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=2000)
    args = parser.parse_args()
    x, out = torch.randn(4096, device="cuda"), torch.empty(4096, device="cuda")
    n, grid = x.numel(), (triton.cdiv(x.numel(), 1024),)
    rows = {
        "aten torch.add(out=)": lambda: torch.add(x, x, out=out),
        "Triton JIT kernel[grid](...)": lambda: _scale_kernel[grid](x, out, n, 2.0, BLOCK=1024),
    }
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, Triton {triton.__version__}")
    print("| launch path | host µs per launch |\n| --- | ---: |")
    for name, launch in rows.items():
        per_launch_us(launch, 100, rounds=1)  # warm
        print(f"| {name} | {per_launch_us(launch, args.launches):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
