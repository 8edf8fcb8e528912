"""``meshtron plan``: the parallel layout for a model on a number of GPUs, by a model of step time.

    meshtron plan --gpus N [--gpus-per-node G] [--gpu h100|h200|mi300x | --calibration FILE]
                  [--inter-node-gbps X] [--top K] [--fp8] [--all] [--config FILE] [--flag value ...]
    meshtron plan --calibrate [--calibration-out FILE] [--config FILE] [--flag value ...]
    meshtron plan --gpus N --measure K [--measure-steps S] ...

The model, sequence and global batch come from the usual config and flags (``--model.preset
llama3-70b --seq-length 8192 --global-batch-size 128``); the layouts are the planner's. Everything
is checked before any GPU is touched; ``--calibrate`` and ``--measure`` then use the GPUs of this
machine.
"""

from __future__ import annotations

import argparse
import dataclasses

from meshtron.config import build_config
from meshtron.estimate import training_vocab_size
from meshtron.planning.hardware import SHIPPED, load
from meshtron.planning.layouts import RECOMPUTES, Space
from meshtron.planning.report import losers, table
from meshtron.planning.search import search
from meshtron.validation import validate

LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--tp", "--pipeline-model-parallel-size", "--pp", "--context-parallel-size",
                "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--virtual-pipeline-model-parallel-size",
                "--micro-batch-size", "--use-distributed-optimizer", "--use-torch-fsdp2", "--recompute-granularity")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshtron plan", description="choose the parallel layout by a model of step time")
    p.add_argument("--config", default=None)
    p.add_argument("--gpus", type=int, default=0, help="GPUs of the run (the world size)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="default: min(--gpus, 8)")
    p.add_argument("--gpu", default="h100", help=f"shipped machine: {', '.join(SHIPPED)} (default h100)")
    p.add_argument("--calibration", default="", help="a file written by --calibrate (replaces --gpu)")
    p.add_argument("--inter-node-gbps", type=float, default=0.0, help="network per GPU, Gbit/s (default: the machine's)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--fp8", action="store_true", help="also consider FP8 linears (--fp8-format hybrid)")
    p.add_argument("--no-fsdp", action="store_true", help="leave FSDP2 out")
    p.add_argument("--recompute", default="none,selective,full", help="recompute granularities to try (none, selective, full)")
    p.add_argument("--max-tp", type=int, default=0, help="default: --gpus-per-node")
    p.add_argument("--max-cp", type=int, default=8)
    p.add_argument("--max-pp", type=int, default=16)
    p.add_argument("--max-virtual", type=int, default=8)
    p.add_argument("--max-micro-batch", type=int, default=8)
    p.add_argument("--all", action="store_true", help="say why each losing layout lost, not only the best few of each kind")
    p.add_argument("--calibrate", action="store_true", help="time this machine's GEMMs, attention and collectives")
    p.add_argument("--calibration-out", default="calibration.json")
    p.add_argument("--measure", type=int, default=0, help="run the top K layouts for a few steps and compare")
    p.add_argument("--measure-steps", type=int, default=6)
    return p


def space_from(args: argparse.Namespace, gpus_per_node: int) -> Space:
    recomputes = tuple("" if r == "none" else r for r in args.recompute.split(","))
    unknown = [r for r in recomputes if r not in RECOMPUTES]
    if unknown:
        raise ValueError(f"--recompute takes none, selective, full (comma-separated), got {args.recompute}")
    return Space(max_tp=args.max_tp or gpus_per_node, max_cp=args.max_cp, max_pp=args.max_pp, max_virtual=args.max_virtual,
                 max_micro_batch=args.max_micro_batch, recomputes=recomputes, fp8=(False, True) if args.fp8 else (False,),
                 fsdp=not args.no_fsdp)  # fmt: skip


def main(argv: list[str]) -> int:
    args, overrides = parser().parse_known_args(argv)
    given = [f for f in overrides if f.split("=")[0] in LAYOUT_FLAGS]
    if given:
        raise ValueError(f"{', '.join(given)}: the planner chooses the layout; drop these flags")
    base_args = (["--config", args.config] if args.config else []) + overrides
    cfg = build_config(args.config, overrides)
    if args.calibrate:
        from meshtron.planning.calibrate import calibrate

        cfg.model.vocab_size = training_vocab_size(cfg)
        calibrate(cfg, args.calibration_out)
        return 0
    if args.gpus < 1:
        raise ValueError("give the number of GPUs of the run: --gpus N")
    gpus_per_node = args.gpus_per_node or min(args.gpus, 8)
    if args.gpus % gpus_per_node and args.gpus > gpus_per_node:
        raise ValueError(f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node {gpus_per_node}")
    cfg.train.micro_batch_size = 1  # the planner chooses it
    validate(cfg, world_size=1)  # the model itself, before any layout
    cfg.model.vocab_size = training_vocab_size(cfg)
    machine = load(args.calibration or args.gpu)
    if args.inter_node_gbps:
        machine = dataclasses.replace(machine, inter_node_gbps=args.inter_node_gbps)
    space = space_from(args, gpus_per_node)
    result = search(cfg, args.gpus, gpus_per_node, machine, space, args.top)
    nodes = max(1, args.gpus // gpus_per_node)
    paper = " (on paper: no number measured on this GPU kind)" if machine.on_paper else ""
    print(f"meshtron plan: {args.gpus} x {machine.device}{paper}, {nodes} node(s) of {min(args.gpus, gpus_per_node)}, "
          f"network {machine.inter_node_gbps:g} Gbit/s per GPU; seq {cfg.data.seq_length}, global batch "
          f"{cfg.train.global_batch_size}; {result.considered} layouts, memory limit {result.usable_bytes / 2**30:.1f} GiB")  # fmt: skip
    print(table(result, base_args))
    print(losers(result, args.all))
    if args.measure:
        from meshtron.planning.measure import measure_top

        print(measure_top(result, base_args, args.measure, args.measure_steps))
    return 0
