"""Output layer + loss, forward and backward, at B1's shape: the per-token chunked loss (4 logits
GEMMs: its backward recomputes the logits) against the masked-sum loss that takes its gradients in
the forward (``--cross-entropy-loss-fusion``, 3 GEMMs). Prints median ms and peak memory of each.

    python benchmarks/cross_entropy_fusion.py [--tokens 16384] [--hidden 2048] [--vocab 128256]

B1: micro batch 4 x sequence 4096 = 16384 tokens, bf16; the loss is divided by the token count as
the runner does. The weight is a leaf like the tied embedding; no gradient buffer is involved.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from b1_llama import time_steps  # CUDA-event timing after warm-up

from meshtron.kernels.cross_entropy import linear_cross_entropy
from meshtron.kernels.cross_entropy_sum import LOGITS_BUDGET_BYTES, linear_cross_entropy_sum


def time_ms(fn, repeats: int) -> tuple[float, float]:
    """Median ms over ``repeats`` after 3 warm-up calls, and the peak memory above the start in GiB."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = statistics.median(time_steps(fn, 0, repeats)) * 1000
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden, device="cuda") * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda")
    mask = torch.ones(args.tokens, device="cuda")
    count = mask.sum()

    def per_token():
        total = (linear_cross_entropy(hidden, weight, labels) * mask).sum()
        torch.autograd.grad(total / count, (hidden, weight))

    def fused(budget: int):
        return lambda: torch.autograd.grad(linear_cross_entropy_sum(hidden, weight, labels, mask, budget_bytes=budget) / count,
                                           (hidden, weight))  # fmt: skip

    print(f"{torch.cuda.get_device_name()}: tokens {args.tokens}, hidden {args.hidden}, vocab {args.vocab}, bf16, fwd+bwd")
    cases = [("per-token chunked (4 GEMMs)", per_token), ("fused sum, one block (3 GEMMs)", fused(LOGITS_BUDGET_BYTES)),
             ("fused sum, 1 GiB blocks (3 GEMMs)", fused(2**30))]  # fmt: skip
    results = {}
    for name, fn in cases:
        ms, peak = time_ms(fn, args.repeats)
        results[name] = ms
        print(f"{name:36s} {ms:8.2f} ms   peak +{peak:5.2f} GiB")
    old = results[cases[0][0]]
    for name, ms in list(results.items())[1:]:
        print(f"{name}: {old - ms:+.2f} ms saved ({old / ms:.3f}x)")


if __name__ == "__main__":
    main()
