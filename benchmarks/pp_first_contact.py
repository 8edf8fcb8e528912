"""Pipelines with one micro batch on NCCL: the first point-to-point contact between two ranks.

    PYTHONPATH=$PWD python benchmarks/pp_first_contact.py [--gpus 2] [--parts raw,train] [--timeout-s 240]

NCCL connects two ranks at their first transfer, inside that group call, by a handshake that
assumes both sides connect the mirrored directions in the same call (``ncclTransportP2pSetup``).
1F1B with one micro batch broke that: rank 0 sent its activation and received its gradient in one
``batch_isend_irecv``, rank 1 received, then sent in a later one (ncclInternalError "Internal check
failed" on a two-rank pipeline group; a hang on four ranks). ``pipeline.connect_links`` now opens
every link at set-up in one mirrored call.

1. ``raw``: that pattern with torch.distributed alone (no meshtron), on 2 GPUs (and its pp4 form
   on 4): ``unmirrored`` posts it as the schedule did, ``connected-first`` after one mirrored
   exchange. Expected: unmirrored fails or hangs (so NCCL, not meshtron's order, is the cause),
   connected-first passes.
2. ``train``: ``meshtron train`` under torchrun as ``plan_check.py`` runs it
   (``planning.measure.train_argv``, 3 steps) with one micro batch per step: on 2 GPUs DeepSeek-V2-Lite x 4 layers
   (layer 0 dense) pp2 mbs 4 of 4, and Llama-3-8B x 4 layers pp2 mbs 1 of 1 with full recompute;
   on 4 GPUs also the failing layouts: DeepSeek pp2 x dp2 mbs 4 of 8 with the distributed optimizer
   and bf16 moments, and Llama-3-70B x 4 layers pp4 mbs 8 of 8 with full recompute. Expected on
   this branch: every layout trains (tokens/s printed). Copied into a checkout without the fix, the
   same layouts fail or time out.

Prints one line per case: ``<case>: ok ...`` or ``<case>: FAILED/HUNG ...``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.planning.layouts import Layout  # noqa: E402
from meshtron.planning.measure import MEMORY, TOKENS, failure_lines, run_until, train_argv  # noqa: E402

DEEPSEEK = ["--model.preset", "deepseek-v2-lite", "--num-layers", "4", "--moe-layer-freq", "([0]+[1]*3)", "--seq-length", "4096"]
LLAMA_8B = ["--model.preset", "llama3-8b", "--num-layers", "4", "--seq-length", "8192"]
LLAMA_70B = ["--model.preset", "llama3-70b", "--num-layers", "4", "--seq-length", "8192"]
# name: (GPUs, base flags, layout)
TRAIN_CASES = {
    "deepseek pp2 mbs4 of 4": (2, DEEPSEEK + ["--global-batch-size", "4"], Layout(1, 2, 1, 1, 1, 1, 1, "none", 4)),
    "llama-8b pp2 mbs1 of 1 rc-full": (2, LLAMA_8B + ["--global-batch-size", "1"], Layout(1, 2, 1, 1, 1, 1, 1, "none", 1, "full")),
    "deepseek pp2 dp2 mbs4 of 8 dist-opt bf16-moments": (4, DEEPSEEK + ["--global-batch-size", "8"],
                                                         Layout(1, 2, 1, 1, 1, 1, 2, "distributed-optimizer", 4, "", True)),
    "llama-70b pp4 mbs8 of 8 rc-full": (4, LLAMA_70B + ["--global-batch-size", "8"], Layout(1, 4, 1, 1, 1, 1, 1, "none", 8, "full")),
}  # fmt: skip


def raw_rank(mode: str) -> None:
    """One torchrun rank of the raw pattern: each rank sends a 64 MiB activation forward and gets
    its gradient back, a pipeline of one micro batch (ranks in a line)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group = dist.new_group(list(range(world)))
    dist.all_reduce(torch.zeros(1, device="cuda"), group=group)  # the communicator, made by every rank
    act, grad = torch.ones(16 << 20, device="cuda"), torch.empty(16 << 20, device="cuda")

    def post(*ops):
        for request in dist.batch_isend_irecv([dist.P2POp(op, t, peer=peer, group=group) for op, t, peer in ops]):
            request.wait()

    if mode == "connected-first":  # every link both ways in one call on every rank
        links = [(dist.isend, torch.zeros(1, device="cuda"), p) for p in (rank - 1, rank + 1) if 0 <= p < world]
        links += [(dist.irecv, torch.empty(1, device="cuda"), p) for p in (rank - 1, rank + 1) if 0 <= p < world]
        post(*links)
    if rank > 0:
        post((dist.irecv, act, rank - 1))
    if rank < world - 1:  # the schedule's one call: the activation out, its gradient back
        post((dist.isend, act, rank + 1), (dist.irecv, grad, rank + 1))
    if rank > 0:
        post((dist.isend, grad, rank - 1))
    torch.cuda.synchronize()
    dist.destroy_process_group()


def run_raw(world: int, mode: str, timeout_s: float) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), __file__, "--raw-rank", mode]
    code, log = run_until(cmd, timeout_s)
    if code == 0:
        return "ok"
    lines = log.splitlines()
    cause = [line for line in lines if "NCCL WARN" in line or "ncclInternalError" in line or "Error" in line][:3]
    status = f"HUNG (no end within {timeout_s:.0f} s)" if code is None else f"FAILED (exit {code})"
    return f"{status}: " + " | ".join(cause or lines[-3:])


def run_train(base: list[str], layout: Layout, timeout_s: float) -> str:
    """``plan_check``'s run of ``layout`` (``planning.measure.train_argv``, 3 steps), read the same way."""
    code, log = run_until(train_argv(base, layout, 3), timeout_s)
    speeds = [float(s.replace(",", "")) for s in TOKENS.findall(log)]
    if code == 0 and speeds:
        peak = max((float(g) for g in MEMORY.findall(log)), default=0.0)
        return f"ok, {statistics.median(speeds[1:] or speeds):,.0f} tokens/s/GPU after the first step, peak {peak:.1f} GiB"
    status = f"HUNG (no result within {timeout_s:.0f} s)" if code is None else f"FAILED (exit {code})"
    return f"{status}: {failure_lines(log)[-300:]}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=0, help="default: all of this machine's")
    parser.add_argument("--parts", default="raw,train", help="raw (torch.distributed alone), train (meshtron train), or both")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per training case, start-up included (raw: 90 s)")
    parser.add_argument("--raw-rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_rank:
        raw_rank(args.raw_rank)
        return 0
    import torch

    gpus = args.gpus or torch.cuda.device_count()
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    parts = args.parts.split(",")
    for world in (2, 4) if "raw" in parts else ():
        if world <= gpus:
            for mode in ("unmirrored", "connected-first"):
                print(f"raw pp{world} one micro batch, {mode}: {run_raw(world, mode, 90.0)}", flush=True)
    for name, (world, base, layout) in TRAIN_CASES.items() if "train" in parts else ():
        if world > gpus:
            print(f"train {name}: needs {world} GPUs, not run", flush=True)
            continue
        print(f"train {name} ({' '.join(layout.flags())}): {run_train(base, layout, args.timeout_s)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
