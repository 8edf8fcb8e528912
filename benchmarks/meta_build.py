"""Start-up of large models with the meta-device build: each rank allocates only its shard.

    # B3 shape start-up on one GPU (time to a built runner, GPU peak while building), for the tree
    # on PYTHONPATH (run it once per tree to compare):
    python benchmarks/meta_build.py startup
    # Llama-3-70B layers (h8192, 64 heads, 8 KV heads, ffn 28672, 128 K vocabulary), tp4 + sp, bf16
    # Adam moments, full recompute, on 4 GPUs: the deepest model ``meshtron estimate`` says fits,
    # built (start-up peak per GPU) and trained 20 steps (losses, peak per GPU against the estimate):
    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/meta_build.py train70b [--layers N]

Prints one line per rank; ``peak`` is ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

GIB = 2**30
B3 = ["--preset", "llama3-8b", "--num-layers", "8", "--seq-length", "8192", "--micro-batch-size", "1", "--global-batch-size", "1",
      "--vocab-size", "128256", "--make-vocab-size-divisible-by", "1", "--mock-data", "--train-iters", "1", "--eval-interval", "0"]  # fmt: skip
L70 = ["--preset", "llama3-70b", "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "4", "--vocab-size",
       "128256", "--make-vocab-size-divisible-by", "1", "--mock-data", "--tp", "4", "--sequence-parallel",
       "--recompute-granularity", "full", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
       "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "2", "--eval-interval", "0", "--log-interval", "1", "--train-iters", "20"]  # fmt: skip


def startup() -> None:
    from meshtron.config import build_config
    from meshtron.training.trainer import Trainer

    torch.cuda.synchronize()
    start = time.perf_counter()
    trainer = Trainer(build_config(None, B3), log=lambda _: None)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"startup B3 (8 x Llama-3-8B layers, 128 K vocab, 1 GPU): {seconds:.1f} s to a built trainer, "
          f"GPU peak while building {torch.cuda.max_memory_allocated() / GIB:.1f} GiB, held {torch.cuda.memory_allocated() / GIB:.1f} GiB")  # fmt: skip
    del trainer


def deepest_fitting(flags: list[str], world: int, budget_gib: float) -> int:
    """The most layers of ``flags`` whose ``meshtron estimate`` for ``world`` GPUs is under ``budget_gib``."""
    from meshtron.config import build_config
    from meshtron.estimate import estimate

    layers = 4
    while estimate(build_config(None, flags + ["--num-layers", str(layers + 4)]), world).total_bytes / GIB < budget_gib:
        layers += 4
    return layers


def train70b(layers: int) -> None:
    from meshtron.config import build_config
    from meshtron.estimate import estimate
    from meshtron.training.trainer import Trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    capacity = torch.cuda.get_device_properties(0).total_memory / GIB
    layers = layers or deepest_fitting(L70, world, 0.90 * capacity)
    cfg = build_config(None, L70 + ["--num-layers", str(layers)])
    predicted = estimate(cfg, world).total_bytes / GIB
    start = time.perf_counter()
    trainer = Trainer(cfg, log=(lambda line: print(line, flush=True)) if rank == 0 else (lambda _: None))
    torch.cuda.synchronize()
    built, build_peak = time.perf_counter() - start, torch.cuda.max_memory_allocated() / GIB
    held = torch.cuda.memory_allocated() / GIB
    result = trainer.run()
    peak = torch.cuda.max_memory_allocated() / GIB
    params = sum(p.numel() for p in trainer.model.parameters())
    print(f"rank {rank}: {layers} layers of Llama-3-70B on {world} GPUs ({capacity:.0f} GiB each): {params / 1e9:.2f} B parameters "
          f"on this rank; built in {built:.1f} s, start-up peak {build_peak:.1f} GiB (held after start-up {held:.1f}); training "
          f"peak {peak:.1f} GiB vs estimate {predicted:.1f} GiB ({peak / predicted - 1:+.1%}); losses "
          f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f} over {len(result.losses)} steps", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["startup", "train70b"])
    parser.add_argument("--layers", type=int, default=0, help="train70b: layers (0: the deepest that fits by the estimate)")
    args = parser.parse_args()
    startup() if args.what == "startup" else train70b(args.layers)


if __name__ == "__main__":
    main()
