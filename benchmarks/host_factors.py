"""The host's time per block under each layout feature the step model prices by a host factor
(``Machine.host_factors``: tp, cp, ep, etp, FSDP2), measured on two or more GPUs the way ``--calibrate``
measures one (``calibrate.host_ms_per_block``): the model cut to one MoE block, then
``SLOPE_BLOCKS`` more of a kind, one micro batch of ``HOST_TOKENS`` tokens a rank, the median
forward + backward (no optimizer step) of each, the difference over the added blocks.

    PYTHONPATH=$PWD python benchmarks/host_factors.py --workload deepseek --out $OUT/host_factors.json

``--recompute full`` measures every layout, the baseline too, under full recompute: what each
feature's Python adds where the recomputed forward reruns it (or does not). Each feature spans
``--ranks`` ranks (2 by default; 4 gives cp4 and ep4, whose host work the step model extrapolates
from cp2 and ep2) under ``torchrun`` (this file with ``--worker``), beside the
baseline of as many data-parallel ranks with the distributed optimizer, whose blocks launch what
one process's do. Writes ``{"ms": {feature: {kind: ms}}, "factors": {feature: {kind: ms over the
baseline's}}}`` and prints them. On the CPU (gloo) it runs too, as a check of the code path:
``--device cpu --flags "--model.preset tiny-mixtral --num-layers 2"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plan_check import WORKLOADS, add_layer_counts, planned_config  # noqa: E402

from meshtron.planning.calibrate import HOST_TOKENS, SLOPE_BLOCKS, cut_model  # noqa: E402
from meshtron.planning.layouts import Layout  # noqa: E402

D = "distributed-optimizer"
FEATURES = ("dp", "tp", "cp", "ep", "etp", "fsdp")


def feature_layout(feature: str, ranks: int, recompute: str = "") -> Layout:
    """``feature`` over all ``ranks``: tp (with sp), cp, ep, etp, FSDP2, or the data-parallel
    baseline; "cp+fsdp" or "ep+fsdp": FSDP2 over the same ranks (whether two features' host work adds)."""
    n = ranks
    if feature.endswith("+fsdp"):
        return dataclasses.replace(feature_layout(feature[: -len("+fsdp")], ranks, recompute), sharding="fsdp")
    return dataclasses.replace({"dp": Layout(1, 1, 1, 1, 1, 1, n, D, 1), "tp": Layout(n, 1, 1, 1, 1, 1, 1, "none", 1),
            "cp": Layout(1, 1, 1, n, 1, 1, 1, D, 1), "ep": Layout(1, 1, 1, 1, n, 1, n, D, 1),
            "etp": Layout(1, 1, 1, 1, 1, n, n, D, 1), "fsdp": Layout(1, 1, 1, 1, 1, 1, n, "fsdp", 1)}[feature], recompute=recompute)  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """One feature on this rank: the median forward + backward of each cut model; rank 0 prints them as JSON."""
    import torch
    import torch.distributed as dist

    from meshtron.parallel.mesh import end_distributed
    from meshtron.training.trainer import Trainer

    cfg = planned_config(args.flags.split() if args.flags else WORKLOADS[args.workload](args))
    if args.device:
        cfg.train.device = args.device
    layout = feature_layout(args.feature, args.ranks, args.recompute)
    sync = torch.cuda.synchronize if torch.cuda.is_available() and args.device != "cpu" else lambda: None
    moe = 1 if cfg.model.num_experts else 0
    medians = {}
    for name, pattern in (("base", [moe]), ("dense", [moe] + [0] * SLOPE_BLOCKS), ("moe", [moe] * (1 + SLOPE_BLOCKS))):
        if name == "moe" and not moe:
            continue
        trainer, times = Trainer(cut_model(cfg, pattern, HOST_TOKENS, layout), log=lambda _: None), []
        for i in range(3 + args.steps):
            dist.barrier()
            sync()
            began = time.perf_counter()
            trainer.accumulate_gradients()
            sync()
            times.append(time.perf_counter() - began) if i >= 3 else None
        medians[name] = 1e3 * statistics.median(times)
        del trainer
    if dist.get_rank() == 0:
        per_block = {kind: (medians[kind] - medians["base"]) / SLOPE_BLOCKS for kind in medians if kind != "base"}
        print("HOST_MS " + json.dumps(per_block), flush=True)
    end_distributed()  # else the process groups' threads can abort the exit (SIGABRT)


def run_feature(args: argparse.Namespace, feature: str) -> dict[str, float]:
    """``feature`` under torchrun on ``--ranks`` ranks; its per-block host milliseconds by kind."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-port", "29600",
               __file__, "--worker", "--feature", feature, "--ranks", str(args.ranks), "--workload", args.workload, "--steps", str(args.steps),
               "--deepseek-layers", str(args.deepseek_layers), "--llama-layers", str(args.llama_layers),
               "--llama70b-layers", str(args.llama70b_layers), "--flags=" + args.flags, "--recompute=" + args.recompute] + (["--device", args.device] if args.device else [])  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("HOST_MS ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{feature}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("HOST_MS "):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    add_layer_counts(parser)
    parser.add_argument("--features", default=",".join(FEATURES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2, help="GPUs (processes) each feature spans; the baseline is dp over as many")
    parser.add_argument("--device", default="", help="cpu: the code path on gloo (the trainer's default otherwise)")
    parser.add_argument("--flags", default="", help="the model's flags instead of the workload's (a tiny one on the CPU)")
    parser.add_argument("--recompute", default="", choices=["", "full"], help="full: every layout (the baseline too) under full recompute")
    parser.add_argument("--timeout-s", type=float, default=240.0)
    parser.add_argument("--out", default="")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--feature", default="dp")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    ms = {}
    for feature in args.features.split(","):
        began = time.time()
        ms[feature] = run_feature(args, feature)
        print(f"{feature}: " + ", ".join(f"{kind} {v:.2f} ms" for kind, v in ms[feature].items()) + f" ({time.time() - began:.0f} s)", flush=True)
    factors = {f: {kind: v / ms["dp"][kind] for kind, v in kinds.items() if ms["dp"].get(kind)} for f, kinds in ms.items() if "dp" in ms}
    print("factors over dp: " + json.dumps({f: {k: round(v, 2) for k, v in kinds.items()} for f, kinds in factors.items()}))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"workload": args.workload, "recompute": args.recompute, "ms": ms, "factors": factors}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
