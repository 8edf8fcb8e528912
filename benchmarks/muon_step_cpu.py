"""Muon's optimizer step on the CPU: its host time and its count of tensor operations (each one a
kernel launch on a GPU), on a small model with B1's structure.

    PYTHONPATH=<checkout> python benchmarks/muon_step_cpu.py [--steps 20] [--hidden 32] [--threads 1]

The model has B1's layer count and blocks (16 layers, 4 query heads per kv group, SwiGLU) at a
small width (16 heads in 4 groups), Newton-Schulz in fp32 (bf16 GEMMs are slow on most CPUs), so Newton-Schulz's arithmetic is small and the step's time is mostly
its per-operation cost, as on a GPU where B1's step is launch-bound outside its large GEMMs.
Printed: the median seconds of ``optimizer.step`` (AdamW's share included) and of Muon's rule
alone, and the aten operations one Muon step dispatches (and how many of them touch data). Run it under two checkouts to compare
them (the script only uses the trainer's public API).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


ALLOCATIONS = {"aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided"}


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, and apart those that touch data (not views
    or allocations: on a GPU, one kernel each; a foreach op counts once)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        self.kernels += not func.is_view and name not in ALLOCATIONS
        return func(*args, **(kwargs or {}))


def median_seconds(fn, steps: int) -> float:
    fn()  # warm-up (first-step index moves)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from meshtron.config import build_config
    from meshtron.training.trainer import Trainer

    h = args.hidden
    flags = ["--mock-data", "--vocab-size", "256", "--make-vocab-size-divisible-by", "1", "--num-layers", "16", "--hidden-size", str(h),
             "--ffn-hidden-size", str(4 * h), "--num-attention-heads", "16", "--num-query-groups", "4", "--swiglu", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--seq-length", "16",
             "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "10", "--fp32", "--device", "cpu", "--lr", "1e-3",
             "--weight-decay", "0.1", "--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]  # fmt: skip
    trainer = Trainer(build_config(None, flags), log=lambda _: None)
    model, optimizer = trainer.model, trainer.optimizer
    gen = torch.Generator().manual_seed(0)
    optimizer.zero_grad()
    sum((p * torch.randn(p.shape, generator=gen)).sum() for p in model.parameters()).backward()
    muon = optimizer.rules["muon"]
    matrices = sum(len(g["params"]) for g in muon.param_groups)
    whole = median_seconds(lambda: optimizer.step(1e-3), args.steps)  # the same gradients each step
    rule = median_seconds(muon.step, args.steps)
    with OpCounter() as counter:
        muon.step()
    print(f"{matrices} Muon matrices (hidden {h}, {args.threads} thread(s)), median of {args.steps}:")
    print(f"optimizer.step {1000 * whole:.2f} ms | Muon rule step {1000 * rule:.2f} ms | aten ops per Muon step {sum(counter.ops.values())}, "
          f"of which touch data {counter.kernels}")
    print("most frequent: " + ", ".join(f"{name} {n}" for name, n in counter.ops.most_common(8)))


if __name__ == "__main__":
    main()
