"""Throughput of any model the training loop builds, and what its checkpoints cost, on this GPU.

    python benchmarks/train_bench.py [--steps 6] [--warmup 3] [--checkpoint DIR] -- <meshtron train flags>
    torchrun --nproc-per-node 2 benchmarks/train_bench.py ... -- --tp 2 ...   (rank 0 prints)

Runs ``meshtron.training.Trainer`` on the given flags (mock data is added), times whole steps with
CUDA events after warm-up (``b1_llama.time_steps``) and prints tokens/s, TFLOP/s (the loop's own
FLOP count: active parameters for mixture-of-experts models) and peak memory; ``--profile`` and
``--find-syncs`` say where the time went and where the host waited (``host_waits.py``). With
``--checkpoint DIR`` it then saves the run's checkpoint synchronously (the save's wall time) and
with ``--async-save`` twice (the stall training sees, and the wait to complete it), loads the
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
from b1_llama import profile_steps, time_steps
from host_waits import find_syncs


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


def checkpoint_costs(trainer, root: Path, step, step_s: float) -> dict:
    """Sync save, async save and load of the trainer's state, timed.

    An asynchronous save's copies to host overlap the next step on the GPU, so its stall is what
    the save and the step after it take beyond a normal step (``step_s``). It is taken twice: the
    first save of a run allocates (page-locks) the host buffers, later ones reuse them.
    """
    from meshtron.checkpoint.checkpoint import load_checkpoint

    out = {}
    _clear(root, trainer.mesh)
    trainer.cfg.checkpoint.save, trainer.cfg.checkpoint.async_save = str(root), False
    torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.save()
    out["sync_save_s"] = time.perf_counter() - start
    for attempt in ("first", "later"):
        _clear(root, trainer.mesh)
        trainer.cfg.checkpoint.async_save = True
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.save()
        out[f"async_{attempt}_save_returns_s"] = time.perf_counter() - start
        step()
        torch.cuda.synchronize()
        out[f"async_{attempt}_stall_s"] = time.perf_counter() - start - step_s
        start = time.perf_counter()
        trainer.finish_save()
        out[f"async_{attempt}_complete_s"] = time.perf_counter() - start  # after the step: the rest of the writing
    out["bytes_on_disk"] = _bytes_on_disk(root)
    out["pinned_host_gib"] = trainer.host_staging.allocated_bytes / 2**30
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
    parser.add_argument("--profile", default="", help="also profile two steps: GPU time by kernel, and how busy the GPU was, to this file")
    parser.add_argument("--trace", default="", help="with --profile: the two steps' timeline as a Chrome trace (.json or .json.gz)")
    parser.add_argument("--find-syncs", default="", help="also run two steps in CUDA's sync debug mode: each call site where the host waited for the GPU, to this file")
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
    if args.profile:
        result["gpu_busy_ms_per_step"] = profile_steps(step, args.profile, args.trace) / 2
    if args.find_syncs:
        result["host_syncs_per_step"] = find_syncs(step, args.find_syncs) / 2
    if args.checkpoint:
        result.update(checkpoint_costs(trainer, Path(args.checkpoint), step, step_s))
    if trainer.mesh.rank == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
