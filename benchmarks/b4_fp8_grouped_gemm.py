"""B4's expert GEMMs in FP8 against bf16: DeepSeek-V2-Lite's shapes (64 experts, fc1 2048 -> 2816,
fc2 1408 -> 2048), 49,152 rows ragged over the experts (B4b's 8192 tokens x top-6), one GPU.

    python benchmarks/b4_fp8_grouped_gemm.py [--rows 49152] [--steps 20] [--warmup 5]

Per layer, in TFLOP/s (each GEMM 2 x rows x in x out FLOPs) and milliseconds:

- the GEMMs alone, on operands cast beforehand: forward (``torch._grouped_mm`` bf16 against
  ``torch._scaled_grouped_mm`` with fast accumulation) and input gradient (exact accumulation);
- the casts FP8 adds: an activation's rowwise cast (one kernel) and the weights' (both amaxes,
  then both copies), in GB/s of the bytes they must move;
- forward + input gradient as the experts run them (casts included): ``grouped_mm`` on ``torch``
  against ``fp8_grouped_mm`` (the weight gradient, bf16 in both, is left out: it does not change).

Timed with CUDA events after warm-up (median of ``--steps``); writes ``$OUT/b4_fp8_grouped_gemm.json``
when ``OUT`` is set.
"""

from __future__ import annotations

import argparse

import torch
from b4_grouped_gemm import EXPERTS, LAYERS, forward_backward, operands, ragged_sizes, time_ms, write_results

from meshtron.layers.moe.fp8_grouped_gemm import e4m3, fp8_grouped_mm, quantize_rows, quantize_weights, scaled_grouped_mm
from meshtron.layers.moe.grouped_gemm import grouped_mm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=49152, help="routed rows (tokens x top-k) in the layer")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    device, bf16 = torch.device("cuda"), torch.bfloat16
    fp8 = e4m3(device)
    sizes = ragged_sizes(args.rows, EXPERTS).to(device)
    offsets = torch.cumsum(sizes, 0, dtype=torch.int32)
    results = {"gpu": torch.cuda.get_device_name(), "rows": args.rows, "experts": EXPERTS, "layers": {}}
    print(f"{results['gpu']}: {EXPERTS} experts, {args.rows} rows (groups {int(sizes.min())}..{int(sizes.max())})")
    print(f"{'layer':<5} {'what':<34} {'bf16 ms':>8} {'TFLOP/s':>8} {'FP8 ms':>8} {'TFLOP/s':>8} {'FP8/bf16':>8}")
    for layer, (k, n) in LAYERS.items():
        flops = 2 * args.rows * k * n
        x, g, w = operands(args.rows, k, n, device)
        xq, x_inv = quantize_rows(x, fp8)
        gq, g_inv = quantize_rows(g, fp8)
        wq = quantize_weights(w, fp8, True, True)
        pairs = {
            "forward GEMM": (lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets),
                             lambda: scaled_grouped_mm(xq, x_inv, wq.rows, wq.rows_inv, sizes, "scaled", bf16, True), 1),
            "input-gradient GEMM": (lambda: torch._grouped_mm(g, w, offs=offsets),
                                    lambda: scaled_grouped_mm(gq, g_inv, wq.transposed, wq.transposed_inv, sizes, "scaled", bf16), 1),
            "forward + input gradient, casts in": (
                forward_backward(x.clone().requires_grad_(True), w, lambda a, b: grouped_mm(a, b, sizes, "torch")),
                forward_backward(x.clone().requires_grad_(True), w, lambda a, b: fp8_grouped_mm(a, b, sizes, "torch")), 2),
        }  # fmt: skip
        row = {}
        for what, (bf16_run, fp8_run, gemms) in pairs.items():
            bf16_ms, fp8_ms = time_ms(bf16_run, args.warmup, args.steps), time_ms(fp8_run, args.warmup, args.steps)
            row[what] = {"bf16_ms": bf16_ms, "fp8_ms": fp8_ms, "bf16_tflops": gemms * flops / bf16_ms / 1e9,
                         "fp8_tflops": gemms * flops / fp8_ms / 1e9}  # fmt: skip
            r = row[what]
            print(f"{layer:<5} {what:<34} {bf16_ms:>8.3f} {r['bf16_tflops']:>8.1f} {fp8_ms:>8.3f} {r['fp8_tflops']:>8.1f} "
                  f"{bf16_ms / fp8_ms:>7.2f}x")  # fmt: skip
        # Bytes each cast must move: a row's bf16 read once (its second read mostly from L2) and its FP8 write;
        # the weights read twice (amaxes, then the copies) and written twice (rows and transposed copies).
        casts = {"activation rows cast": (lambda: quantize_rows(x, fp8), x.numel() * 3),
                 "weights: amaxes + both copies": (lambda: quantize_weights(w, fp8, True, True), w.numel() * 6)}  # fmt: skip
        for what, (run, nbytes) in casts.items():
            ms = time_ms(run, args.warmup, args.steps)
            row[what] = {"ms": ms, "gbps": nbytes / ms / 1e6}
            print(f"{layer:<5} {what:<34} {'':>8} {'':>8} {ms:>8.3f} {nbytes / ms / 1e6:>7.0f} GB/s")
        results["layers"][layer] = row
    write_results(results, "b4_fp8_grouped_gemm.json")


if __name__ == "__main__":
    main()
