"""B4's expert compute: the grouped GEMMs of a DeepSeek-V2-Lite MoE layer against a dense matmul.

    python benchmarks/b4_grouped_gemm.py [--rows 49152] [--steps 20] [--backends loop,torch,triton]

At DeepSeek-V2-Lite's expert shapes (64 experts, hidden 2048, expert FFN 1408, SwiGLU so fc1 is
2048 -> 2x1408 and fc2 1408 -> 2048; 49k routed rows, ragged over the experts as a router
leaves them, bf16), times forward + backward of fc1 and of fc2 with each grouped-GEMM backend,
and a dense ``[rows, K] @ [K, N]`` forward + backward of the same FLOPs. Prints TFLOP/s of each
and each backend's fraction of dense (B4's target: expert compute >= 90 % of dense); writes the
numbers to ``$OUT/b4_grouped_gemm.json`` when ``OUT`` is set.

``--per-gemm`` times each GEMM of the pair alone instead (forward, input gradient, weight gradient
in bf16, and the weight gradient added into an fp32 ``main_grad`` as gradient-accumulation fusion
runs it, Triton only), each against ``torch._grouped_mm`` and a dense GEMM of the same FLOPs
(``$OUT/b4_grouped_per_gemm.json``), the three timed in turn ``--rounds`` times and each one's
median kept: one pass each moved a GEMM by up to 13 % between two scripts of one call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable

import torch
from b1_llama import time_steps  # CUDA-event timing after warm-up

from meshtron.layers.moe.grouped_gemm import grouped_mm

EXPERTS, HIDDEN, EXPERT_FFN = 64, 2048, 1408
LAYERS = {"fc1": (HIDDEN, 2 * EXPERT_FFN), "fc2": (EXPERT_FFN, HIDDEN)}


def ragged_sizes(rows: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Group sizes summing to ``rows``, skewed like a router's (a few experts take several times the mean)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=gen) + 0.25
    sizes = (weights / weights.sum() * rows).floor().long()
    sizes[0] += rows - sizes.sum()
    return sizes


def time_ms(fn, warmup: int, steps: int) -> float:
    """Median milliseconds of ``fn`` with CUDA events, after warm-up (which also autotunes)."""
    return statistics.median(time_steps(fn, warmup, steps)) * 1000


def forward_backward(x: torch.Tensor, weight: torch.Tensor, run) -> Callable[[], None]:
    """One forward and backward of ``run(x, weight)``: the input gradient, and the weight's where it requires one."""
    upstream = torch.randn(x.shape[0], weight.shape[-2], device=x.device, dtype=x.dtype)  # out [R, N]

    def step():
        x.grad = weight.grad = None
        run(x, weight).backward(upstream)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=49152, help="routed rows (tokens x top-k) in the layer")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backends", default="loop,torch,triton")
    parser.add_argument("--per-gemm", action="store_true", help="time each GEMM alone (torch and triton backends)")
    parser.add_argument("--rounds", type=int, default=3, help="--per-gemm: the backends timed in turn this many times, median kept")
    args = parser.parse_args()
    if args.per_gemm:
        return per_gemm(args)
    device, dtype = torch.device("cuda"), torch.bfloat16
    sizes = ragged_sizes(args.rows, EXPERTS).to(device)
    results = {"gpu": torch.cuda.get_device_name(), "rows": args.rows, "experts": EXPERTS, "dtype": "bf16",
               "group_sizes_min_max": [int(sizes.min()), int(sizes.max())], "layers": {}}  # fmt: skip
    print(f"{results['gpu']}: {EXPERTS} experts, {args.rows} rows (groups {results['group_sizes_min_max']}), bf16, fwd+bwd")
    print(f"{'layer':<5} {'backend':<8} {'ms':>8} {'TFLOP/s':>8} {'of dense':>9}")
    for layer, (k, n) in LAYERS.items():
        flops = 3 * 2 * args.rows * k * n  # forward, input gradient, weight gradient
        x = torch.randn(args.rows, k, device=device, dtype=dtype, requires_grad=True)
        dense_w = (torch.randn(n, k, device=device, dtype=dtype) * k**-0.5).requires_grad_()
        dense_ms = time_ms(forward_backward(x, dense_w, lambda a, w: a @ w.t()), args.warmup, args.steps)
        row = {"dense": {"ms": dense_ms, "tflops": flops / dense_ms / 1e9}}
        weight = (torch.randn(EXPERTS, n, k, device=device, dtype=dtype) * k**-0.5).requires_grad_()
        for backend in args.backends.split(","):
            run = lambda a, w, b=backend: grouped_mm(a, w, sizes, b)
            try:
                ms = time_ms(forward_backward(x, weight, run), args.warmup, args.steps)
            except RuntimeError as exc:  # e.g. torch._grouped_mm missing on this build
                print(f"{layer:<5} {backend:<8} skipped: {exc}")
                continue
            row[backend] = {"ms": ms, "tflops": flops / ms / 1e9, "of_dense": dense_ms / ms}
        results["layers"][layer] = row
        for name, r in row.items():
            print(f"{layer:<5} {name:<8} {r['ms']:>8.3f} {r['tflops']:>8.1f} {r.get('of_dense', 1.0):>8.1%}")
    # The layer's expert compute as a whole: fc1 and fc2, forward and backward.
    flops = sum(3 * 2 * args.rows * k * n for k, n in LAYERS.values())
    layers = results["layers"].values()
    total = {name: sum(row[name]["ms"] for row in layers) for name in next(iter(layers)) if all(name in row for row in layers)}
    results["total"] = {name: {"ms": ms, "tflops": flops / ms / 1e9, "of_dense": total["dense"] / ms} for name, ms in total.items()}
    for name, r in results["total"].items():
        print(f"{'both':<5} {name:<8} {r['ms']:>8.3f} {r['tflops']:>8.1f} {r['of_dense']:>8.1%}")
    write_results(results, "b4_grouped_gemm.json")


def gemm_calls(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, sizes: torch.Tensor) -> dict[str, dict[str, Callable]]:
    """Each GEMM of a grouped linear's forward and backward, per backend, plus its dense twin.
    x [R, K], weight [E, N, K], dy [R, N]."""
    from meshtron.kernels.triton_grouped_gemm import (
        group_offsets,
        group_weight_grad,
        rows_times_group,
    )

    ends, offsets = torch.cumsum(sizes, 0, dtype=torch.int32), group_offsets(sizes)
    experts, n, k = weight.shape
    dense_w = weight[0].clone()
    main_grad = torch.zeros(experts, n, k, device=x.device, dtype=torch.float32)
    return {
        "forward": {"dense": lambda: x @ dense_w.t(), "torch": lambda: torch._grouped_mm(x, weight.transpose(1, 2), offs=ends),
                    "triton": lambda: rows_times_group(x, weight.transpose(1, 2), offsets)},
        "input grad": {"dense": lambda: dy @ dense_w, "torch": lambda: torch._grouped_mm(dy, weight, offs=ends),
                       "triton": lambda: rows_times_group(dy, weight, offsets)},
        "weight grad": {"dense": lambda: dy.t() @ x, "torch": lambda: torch._grouped_mm(dy.t(), x, offs=ends),
                        "triton": lambda: group_weight_grad(dy, x, offsets, experts)},
        # the bar: a dense bf16 GEMM of the same FLOPs
        "weight grad into fp32 main_grad": {"dense": lambda: dy.t() @ x,
                                            "triton": lambda: group_weight_grad(dy, x, offsets, experts, out=main_grad, accumulate=True)},
    }


def operands(rows: int, k: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A grouped linear's bf16 input x [rows, k], output gradient dy [rows, n] and expert weights [E, n, k]."""
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    return x, dy, torch.randn(EXPERTS, n, k, device=device, dtype=torch.bfloat16) * k**-0.5


def per_gemm(args) -> None:
    """Each GEMM alone (``--per-gemm``): ms, TFLOP/s, and its fraction of the dense twin and of torch's."""
    device = torch.device("cuda")
    sizes = ragged_sizes(args.rows, EXPERTS).to(device)
    results = {"gpu": torch.cuda.get_device_name(), "rows": args.rows, "experts": EXPERTS, "gemms": {}}
    print(f"{results['gpu']}: {EXPERTS} experts, {args.rows} rows, bf16, each GEMM alone")
    print(f"{'layer':<5} {'GEMM':<32} {'backend':<7} {'ms':>7} {'TFLOP/s':>8} {'of dense':>9} {'of torch':>9}")
    for layer, (k, n) in LAYERS.items():
        flops = 2 * args.rows * k * n
        x, dy, weight = operands(args.rows, k, n, device)
        for gemm, calls in gemm_calls(x, weight, dy, sizes).items():
            rounds = [{name: time_ms(fn, args.warmup, args.steps) for name, fn in calls.items()} for _ in range(args.rounds)]
            ms = {name: statistics.median(r[name] for r in rounds) for name in calls}
            row = {name: {"ms": t, "tflops": flops / t / 1e9, "of_dense": ms["dense"] / t,
                          "of_torch": ms["torch"] / t if "torch" in ms else None} for name, t in ms.items()}  # fmt: skip
            results["gemms"][f"{layer} {gemm}"] = row
            for name, r in row.items():
                of_torch = f"{r['of_torch']:>8.1%}" if r["of_torch"] is not None else f"{'-':>9}"
                print(f"{layer:<5} {gemm:<32} {name:<7} {r['ms']:>7.3f} {r['tflops']:>8.1f} {r['of_dense']:>8.1%} {of_torch}")
    print_chosen_tiles()
    write_results(results, "b4_grouped_per_gemm.json")


def print_chosen_tiles() -> None:
    """The tile each autotuned Triton grouped-GEMM kernel chose, per autotuning key."""
    from meshtron.kernels import triton_grouped_gemm

    for name in ("_rows_tma_tuned", "_rows_tuned", "_weight_grad_tuned"):
        for key, config in getattr(triton_grouped_gemm, name).cache.items():
            print(f"chosen by {name} for {key}: {config}")


def write_results(results: dict, name: str) -> None:
    """``results`` as JSON into ``$OUT/name`` when the device call set ``OUT``."""
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], name)
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
