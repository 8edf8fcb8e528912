"""Can the fused AdamW step hide behind GEMMs on a second stream? (one GPU)

    python benchmarks/optimizer_overlap_probe.py [--params 2.25e9] [--gemms 48]

At global batch 1 the optimizer step is a large share of a step (B4b: 22.5 of 83 ms on an H100),
memory-bound where the next forward's GEMMs are compute-bound. If the two ran well side by side,
an optimizer step per layer on a side stream, each layer's forward waiting for its own parameters,
would hide most of it. This times ``--params`` fp32 parameters through ``fused_adamw`` (fp32 moments,
bf16 model copy) in 8 chunks, and ``--gemms`` bf16 GEMMs of 8192 x 4096 x 4096: each alone, one
after the other, and at once on two streams (each chunk free, or each eighth of the GEMMs waiting
for its chunk as a forward would), with the side stream at the default and at high priority.
"""

from __future__ import annotations

import argparse

import torch
from b4_grouped_gemm import time_ms  # median of CUDA-event steps after warm-up

from meshtron.kernels.fused_adamw import block_groups, fused_adamw

CHUNKS = 8
WARMUP, STEPS = 2, 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=2.25e9, help="parameters the optimizer updates (B4b: 2.25e9)")
    parser.add_argument("--gemms", type=int, default=48, help="bf16 GEMMs of 8192 x 4096 x 4096 beside it")
    args = parser.parse_args()
    n, dev = int(args.params), torch.device("cuda")
    torch.manual_seed(0)
    master, grad = torch.randn(n, device=dev).mul_(0.02), torch.randn(n, device=dev).mul_(1e-3)
    exp_avg, exp_avg_sq, model = torch.zeros(n, device=dev), torch.zeros(n, device=dev), master.to(torch.bfloat16)
    group_index = torch.zeros(n, dtype=torch.uint8, device=dev)
    bounds = [n * i // CHUNKS // 4096 * 4096 for i in range(CHUNKS)] + [n]
    chunks = [(lo, hi, block_groups(group_index[lo:hi])) for lo, hi in zip(bounds, bounds[1:])]
    coef = torch.ones((), device=dev)
    a = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def adamw(lo: int, hi: int, blocks: torch.Tensor) -> None:
        fused_adamw(grad[lo:hi], master[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], model[lo:hi], group_index[lo:hi], blocks,
                    coef=coef, decay=[0.99], step=1, lr=1e-4, betas=(0.9, 0.95), eps=1e-8)  # fmt: skip

    def gemms(count: int) -> None:
        for _ in range(count):
            torch.mm(a, b)

    def serial() -> None:
        gemms(args.gemms)
        for chunk in chunks:
            adamw(*chunk)

    def side_by_side(priority: int, chained: bool) -> None:
        side, main_stream = torch.cuda.Stream(priority=priority), torch.cuda.current_stream()
        side.wait_stream(main_stream)
        done = []
        with torch.cuda.stream(side):
            for chunk in chunks:
                adamw(*chunk)
                done.append(torch.cuda.Event())
                done[-1].record(side)
        for event in done:
            if chained:
                main_stream.wait_event(event)
            gemms(args.gemms // CHUNKS)
        main_stream.wait_stream(side)

    gemm_ms = time_ms(lambda: gemms(args.gemms), WARMUP, STEPS)
    adamw_ms = time_ms(lambda: [adamw(*chunk) for chunk in chunks], WARMUP, STEPS)
    print(f"{torch.cuda.get_device_name()}: {n / 1e9:.2f} B parameters, fp32 AdamW in {CHUNKS} chunks; {args.gemms} GEMMs 8192 x 4096 x 4096 bf16")
    print(f"GEMMs alone {gemm_ms:.2f} ms; AdamW alone {adamw_ms:.2f} ms ({n * 30 / adamw_ms / 1e9:.2f} TB/s at 30 bytes a parameter)")
    print(f"one after the other: {time_ms(serial, WARMUP, STEPS):.2f} ms (sum of the two alone {gemm_ms + adamw_ms:.2f})")
    for priority in (0, -1):
        for chained in (False, True):
            ms = time_ms(lambda: side_by_side(priority, chained), WARMUP, STEPS)
            print(f"two streams, side priority {priority:>2}, GEMMs {'waiting per chunk' if chained else 'free':<17}: {ms:.2f} ms "
                  f"(hides {gemm_ms + adamw_ms - ms:.2f} of at most {min(gemm_ms, adamw_ms):.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
