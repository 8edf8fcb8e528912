"""Throughput of any model the training loop builds, and what its checkpoints cost, on this GPU.

    python benchmarks/train_bench.py [--steps 6] [--warmup 3] [--checkpoint DIR] -- <meshtron train flags>
    torchrun --nproc-per-node 2 benchmarks/train_bench.py ... -- --tp 2 ...   (rank 0 prints)

Runs ``meshtron.training.Trainer`` on the given flags (mock data is added), times whole steps with
CUDA events after warm-up (``b1_llama.time_steps``) and prints tokens/s, TFLOP/s (the loop's own
FLOP count: active parameters for mixture-of-experts models) and peak memory. With
``--checkpoint DIR`` it then saves the run's checkpoint synchronously (the save's wall time) and
with ``--async-save`` (the stall the training step sees, and the wait to complete it), loads the
checkpoint back into the same model (the load's wall time), and reports the bytes on disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from b1_llama import time_steps


def _bytes_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _clear(root: Path, mesh) -> None:
    """Remove ``root`` on rank 0 once every rank is done with it, while the others wait (a save
    must not start into a half-removed tree, nor a rank still be reading it)."""
    if mesh.world_size > 1:
        torch.distributed.barrier()
    if mesh.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    if mesh.world_size > 1:
        torch.distributed.barrier()


def checkpoint_costs(trainer, root: Path) -> dict:
    """Sync save, async save (stall, then completion) and load of the trainer's state, timed."""
    from meshtron.checkpoint.checkpoint import load_checkpoint

    out = {}
    for mode in ("sync", "async"):
        _clear(root, trainer.mesh)
        trainer.cfg.checkpoint.save, trainer.cfg.checkpoint.async_save = str(root), mode == "async"
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.save()
        torch.cuda.synchronize()
        out[f"{mode}_step_s"] = time.perf_counter() - start  # what the training step waits
        start = time.perf_counter()
        trainer.finish_save()
        out[f"{mode}_complete_s"] = time.perf_counter() - start
    out["bytes_on_disk"] = _bytes_on_disk(root)
    torch.cuda.synchronize()
    start = time.perf_counter()
    load_checkpoint(root, trainer.model, trainer.optimizer, load_rng=False, mesh=trainer.mesh, metas=trainer.runner.metas)
    torch.cuda.synchronize()
    out["load_s"] = time.perf_counter() - start
    _clear(root, trainer.mesh)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--checkpoint", default="", help="directory to time checkpoint save/load in")
    parser.add_argument("flags", nargs="*", help="meshtron train flags, after --")
    args = parser.parse_args()
    from meshtron.config import build_config
    from meshtron.training.trainer import Trainer

    flags = args.flags + ["--mock-data", "--train-iters", "1000", "--log-interval", "1000000", "--eval-interval", "0"]
    trainer = Trainer(build_config(None, flags), log=lambda s: print("[meshtron]", s, file=sys.stderr))  # rank 0 logs
    losses = []

    def step() -> None:
        loss, _ = trainer.train_step()
        trainer.iteration += 1
        losses.append(loss)

    torch.cuda.reset_peak_memory_stats()
    times = time_steps(step, args.warmup, args.steps)
    cfg = trainer.cfg
    tokens = cfg.train.global_batch_size * cfg.data.seq_length / trainer.mesh.world_size
    step_s = statistics.median(times)
    result = {
        "device": torch.cuda.get_device_name(),
        "tokens_per_s": tokens / step_s,
        "tflops": tokens / step_s * trainer.flops_per_token / 1e12,
        "step_s": step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": [round(x, 4) for x in losses],
    }
    if args.checkpoint:
        result.update(checkpoint_costs(trainer, Path(args.checkpoint)))
    if trainer.mesh.rank == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
