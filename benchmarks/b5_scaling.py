"""B5: data- and tensor-parallel throughput on the GPUs of one host, through the real training loop.

    python benchmarks/b5_scaling.py --layouts dp1,dp2,tp2 [--layers 8] [--seq-length 8192] [--steps 8]

Each layout is one ``torchrun`` launch of ``meshtron.training.Trainer`` on mock tokens with the
Llama-3-8B layer shapes (h4096, 32 heads, 8 KV heads, ffn 14336, 128 K vocabulary; ``--layers``
of them), bf16 with fp32 master weights, the same global batch for every layout (so the losses of
every step are comparable: the bf16 equivalence check), distributed optimizer on for dp > 1.
Per-GPU tokens/s and TFLOP/s come from CUDA-event timing of whole steps after warm-up. The
communication hidden behind computation (data parallel, or tensor parallel's sequence gathers and
reduce-scatters) comes from a profile of one more step: the share of the NCCL kernels' time during
which a compute kernel ran too (``hidden``; the ``tp2ovsm`` layout's copy-engine transfers are no
kernels and are not counted); ``comm s`` is the data-parallel collectives' time run alone. The
``dp*opg`` layouts add ``--overlap-param-gather`` to the distributed optimizer (the parameter
all-gathers of one step run during the next step's forward: for the profile those of the step
before are held back and launched by the profiled step's first forward, so ``hidden`` counts them
beside its reduce-scatters); against dp1 and the plain layouts: ``--layouts dp1,dp2,dp2opg --layers
8 --seq-length 8192 --global-batch 8``. The ``tp*ov`` layouts add ``--tp-comm-overlap``; for the tp2-vs-dp2 ratio run
``--layouts dp2,tp2,tp2ov --layers 8 --seq-length 8192 --global-batch 8``; one pair of linears at a
time: ``benchmarks/tp_overlap_pairs.py``. For pipeline
layouts the bubble column is ``measured/modeled/theory [layers per chunk]``: step time over dp1's
step time / pp, minus one; the same on the schedule's clock with the split's modeled chunk costs
(``pipeline_schedules.modeled_bubble``); the schedule's ``(pp - 1) / (virtual * m)`` for equal
chunks. ``pp2v2`` (split by modeled cost) against ``pp2v2even`` (``--pipeline-split uniform``)
measures what balancing buys. ``--model deepseek-v2-lite --micro-batch-size 2 --seq-length 4096``
runs its MoE shape instead (layer 0 dense, the rest 64 experts top-6 + 2 shared): ``ep2`` (experts
split over the two ranks, tokens exchanged all-to-all; ``ep2ag``: all-gathered) against ``dp2``;
``hidden`` then includes the all-to-all's NCCL kernels, and ``a2a hidden`` is theirs alone (NCCL's
send/receive kernels). ``ep2ov`` / ``ep4ov`` / ``ep2etp2ov`` add ``--overlap-moe-expert-parallel-comm``
(``*ov4``: 4 chunks of local experts); beside their plain layout a line says how much step time the
overlap saves against the plain layout's all-to-all kernel time (which includes each kernel's wait
for the slower rank). For ep at 2 GPUs: ``--model deepseek-v2-lite --micro-batch-size 2
--seq-length 4096 --layers 4 --layouts dp1,ep2,ep2ov,ep2ov4``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from b1_llama import time_steps
from child import report, run_child  # benchmarks/child.py: the child-process protocol

LAYOUT_FLAGS = {
    "dp1": (1, []),
    "dp2": (2, ["--use-distributed-optimizer"]),
    "dp2ar": (2, []),  # plain all-reduce data parallelism (optimizer state replicated)
    "dp4": (4, ["--use-distributed-optimizer"]),
    "dp8": (8, ["--use-distributed-optimizer"]),
    # --overlap-param-gather: the sharded step's parameter all-gathers run during the next forward
    "dp2opg": (2, ["--use-distributed-optimizer", "--overlap-param-gather"]),
    "dp4opg": (4, ["--use-distributed-optimizer", "--overlap-param-gather"]),
    "dp8opg": (8, ["--use-distributed-optimizer", "--overlap-param-gather"]),
    "tp2": (2, ["--tp", "2", "--sequence-parallel"]),
    "tp4": (4, ["--tp", "4", "--sequence-parallel"]),
    "tp8": (8, ["--tp", "8", "--sequence-parallel"]),
    # --tp-comm-overlap: sp's gathers and reduce-scatters pipelined with the GEMMs (portable p2p backend),
    # or through PyTorch's symmetric-memory async-TP ops ("sm"; falls back to p2p with a warning where unusable)
    "tp2ov": (2, ["--tp", "2", "--sequence-parallel", "--tp-comm-overlap"]),
    "tp2ovsm": (2, ["--tp", "2", "--sequence-parallel", "--tp-comm-overlap", "--tp-comm-overlap-backend", "symm_mem"]),
    "tp4ov": (4, ["--tp", "4", "--sequence-parallel", "--tp-comm-overlap"]),
    "tp4ovsm": (4, ["--tp", "4", "--sequence-parallel", "--tp-comm-overlap", "--tp-comm-overlap-backend", "symm_mem"]),
    # "b": one collective per op, the input-gradient reduce-scatter left in flight behind the wgrad GEMM
    "tp2ovb": (2, ["--tp", "2", "--sequence-parallel", "--tp-comm-overlap", "--tp-comm-overlap-backend", "bulk"]),
    "tp4ovb": (4, ["--tp", "4", "--sequence-parallel", "--tp-comm-overlap", "--tp-comm-overlap-backend", "bulk"]),
    "tp8ov": (8, ["--tp", "8", "--sequence-parallel", "--tp-comm-overlap"]),
    # pipeline: the last stage also carries the 128K-vocabulary output layer (~2 layers of work);
    # the default split by modeled cost gives it fewer layers (8 layers: pp2 5|3, pp2v2 2|3|3|0),
    # the *even layouts split the layers evenly (--pipeline-split uniform) for comparison
    "pp2": (2, ["--pp", "2"]),
    "pp2even": (2, ["--pp", "2", "--pipeline-split", "uniform"]),
    "pp2v2": (2, ["--pp", "2", "--virtual-pipeline-model-parallel-size", "2"]),
    "pp2v2even": (2, ["--pp", "2", "--virtual-pipeline-model-parallel-size", "2", "--pipeline-split", "uniform"]),
    # mixture of experts (--model deepseek-v2-lite): experts split over 2 ranks, tokens exchanged all-to-all or all-gathered
    "ep2": (2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "ep2ag": (2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--moe-token-dispatcher-type", "allgather"]),
    # --overlap-moe-expert-parallel-comm: the all-to-all in chunks of local experts, each chunk's transfer under
    # another chunk's experts (2 chunks; *ov4: 4)
    "ep2ov": (2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-moe-expert-parallel-comm"]),
    "ep2ov4": (2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-moe-expert-parallel-comm",
                   "--model.moe_ep_overlap_chunks", "4"]),
    # expert tensor parallelism: every expert's FFN split over 2 ranks (etp2), with ep on 4 GPUs, and ep beside tp + sp
    "etp2": (2, ["--expert-tensor-parallel-size", "2", "--use-distributed-optimizer"]),
    "ep4": (4, ["--expert-model-parallel-size", "4", "--use-distributed-optimizer"]),
    "ep2etp2": (4, ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2", "--use-distributed-optimizer"]),
    "ep4ov": (4, ["--expert-model-parallel-size", "4", "--use-distributed-optimizer", "--overlap-moe-expert-parallel-comm"]),
    "ep4ov4": (4, ["--expert-model-parallel-size", "4", "--use-distributed-optimizer", "--overlap-moe-expert-parallel-comm",
                   "--model.moe_ep_overlap_chunks", "4"]),
    "ep2etp2ov": (4, ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2", "--use-distributed-optimizer",
                      "--overlap-moe-expert-parallel-comm"]),
    "tp2ep2": (4, ["--tp", "2", "--sequence-parallel", "--expert-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "pp4": (4, ["--pp", "4"]),
    "pp4v2": (4, ["--pp", "4", "--virtual-pipeline-model-parallel-size", "2"]),
    # zero-bubble schedules: backward split into input-gradient (B) and weight-gradient (W) passes
    "pp4zb": (4, ["--pp", "4", "--pipeline-schedule", "zb-h1"]),
    "pp4zbv": (4, ["--pp", "4", "--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"]),
    "pp2zb": (2, ["--pp", "2", "--pipeline-schedule", "zb-h1"]),
}


def worker(args) -> None:
    import torch

    from meshtron.config import build_config, data_parallel_size
    from meshtron.training.trainer import Trainer

    model = ["--preset", args.model, "--num-layers", str(args.layers)]
    if args.model.startswith("deepseek"):  # DeepSeek's layer 0 is dense, the rest MoE
        model += ["--moe-layer-freq", f"([0]+[1]*{args.layers - 1})"]
    flags = [
        *model, "--mock-data", "--seq-length", str(args.seq_length),
        "--micro-batch-size", str(args.micro_batch_size), "--train-iters", "1000", "--bf16",
        "--log-interval", "1000000", "--eval-interval", "0", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "2",
    ] + LAYOUT_FLAGS[args.layout][1]
    global_batch = args.global_batch
    if args.weak:  # the same micro batches per data-parallel rank whatever the layout
        global_batch *= data_parallel_size(build_config(None, flags), int(os.environ["WORLD_SIZE"]))
    flags += ["--global-batch-size", str(global_batch)]
    trainer = Trainer(build_config(None, flags), log=lambda s: print("[meshtron]", s, file=sys.stderr) if int(os.environ.get("RANK", 0)) == 0 else None)
    losses = []

    def step() -> None:
        loss, _ = trainer.train_step()
        trainer.iteration += 1
        losses.append(loss)

    times = time_steps(step, args.warmup, args.steps)  # back to back, as training runs
    peak = torch.cuda.max_memory_allocated() / 2**30  # before the benchmark's own buffers below
    mesh = trainer.mesh
    profiled = (mesh.dp > 1 or mesh.tp > 1) and mesh.pp == 1
    # --overlap-param-gather: a step's parameter gathers run during the next step's forward. For the
    # profile they are held back by one step, so the profiled step's first forward launches them
    # (inside the window), and its own ones are launched after it; every rank alike.
    start_param_sync, trainer.optimizer.start_param_sync = trainer.optimizer.start_param_sync, lambda: None
    if profiled:
        trainer.train_step()
    hidden = _profile_comm_overlap(trainer, args.trace_dir, args.layout) if profiled and mesh.rank == 0 else None
    if profiled and mesh.rank != 0:
        trainer.train_step()  # rank 0 profiles one more step; the others take part in it
    trainer.optimizer.start_param_sync = start_param_sync
    trainer.optimizer.finish_param_sync()
    comm = _time_gradient_collectives(trainer) if mesh.dp > 1 else None
    if mesh.rank == 0:
        from meshtron.config import virtual_stages
        from meshtron.models import num_blocks
        from meshtron.parallel.pipeline_schedules import modeled_bubble

        runner = trainer.runner
        modeled = None
        if mesh.pp > 1 and runner.costs is not None:
            modeled = modeled_bubble(runner.schedule, mesh.pp, trainer.num_micro_batches, runner.costs.chunk_costs(runner.split))
        report(dict(split=[len(r) for r in runner.split], modeled_bubble=modeled,
                    layout=args.layout, world=mesh.world_size, global_batch=global_batch, dp=mesh.dp, pp=mesh.pp, virtual=virtual_stages(trainer.cfg.parallel, num_blocks(trainer.cfg.model)),
                                          micro_per_rank=trainer.num_micro_batches,
                                          step_s=statistics.median(times), losses=losses, peak_gib=peak, comm_s=comm, hidden=hidden,
                                          flops_per_token=trainer.flops_per_token, device=torch.cuda.get_device_name()))


def _time_gradient_collectives(trainer) -> float:
    """The bytes a data-parallel step moves, alone: fp32 grads reduce-scattered + bf16 params
    all-gathered (distributed optimizer), or all-reduced. Seconds, median of 3; None (on every
    rank) where a model that fills the GPU leaves no room for these buffers."""
    import torch
    import torch.distributed as dist

    mesh = trainer.mesh
    numel = sum(p.numel() for p in trainer.model.parameters())
    numel -= numel % mesh.dp
    fits = torch.tensor([float(torch.cuda.mem_get_info()[0] > 1.2 * 6 * numel)], device="cuda")
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if not fits.item():
        return None
    grads = torch.randn(numel, device="cuda")
    params = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    shard_g = torch.empty(numel // mesh.dp, device="cuda")
    shard_p = torch.empty(numel // mesh.dp, device="cuda", dtype=torch.bfloat16)
    samples = []
    for i in range(4):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if trainer.cfg.parallel.use_distributed_optimizer:
            dist.reduce_scatter_tensor(shard_g, grads, group=mesh.dp_group)
            dist.all_gather_into_tensor(params, shard_p, group=mesh.dp_group)
        else:
            dist.all_reduce(grads, group=mesh.dp_group)
        end.record()
        torch.cuda.synchronize()
        if i:
            samples.append(start.elapsed_time(end) / 1000)
    return statistics.median(samples)


def _profile_comm_overlap(trainer, trace_dir: str = "", layout: str = "") -> dict:
    """Profile one training step and measure how much of the NCCL kernels' time ran while a
    compute kernel ran on another stream: the communication hidden behind computation. With
    ``trace_dir``, rank 0's timeline of that step is kept there (``trace_<layout>.json.gz``)."""
    import gzip
    import tempfile

    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        trainer.train_step()
        torch.cuda.synchronize()
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    if trace_dir:
        with open(path, "rb") as src, gzip.open(os.path.join(trace_dir, f"trace_{layout}.json.gz"), "wb") as dst:
            dst.write(src.read())
    kernels = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
    comm = [e for e in kernels if "nccl" in e["name"].lower()]
    compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower())
    merged = []
    for a, b in compute:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])

    def hidden(events: list[dict]) -> tuple[float, float]:
        """(kernel time, the part of it a compute kernel ran beside), ms."""
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in events]
        return sum(b - a for a, b in spans) / 1000, sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in merged) / 1000

    total, overlapped = hidden(comm)
    # NCCL runs all_to_all_single as grouped sends and receives (newer builds: an AllToAll kernel): the
    # expert-parallel exchange (and its counts), apart from the data-parallel reduce-scatters and gathers
    a2a_ms, a2a_hidden_ms = hidden([e for e in comm if any(k in e["name"].lower() for k in ("sendrecv", "alltoall"))])
    return {"nccl_ms": total, "overlapped_ms": overlapped, "fraction": overlapped / total if total else 0.0,
            "a2a_ms": a2a_ms, "a2a_hidden_ms": a2a_hidden_ms}  # fmt: skip


def _print_overlap_gains(rows: list[dict]) -> None:
    """Per overlapped expert layout (``ep2ov``...) beside its plain one (``ep2``): the step time it
    saves against the plain layout's all-to-all kernel time (rank 0's profiled step, per step)."""
    by_layout = {r["layout"]: r for r in rows}
    for name, r in by_layout.items():
        plain = by_layout.get(name.split("ov")[0]) if "ov" in name and name.startswith("ep") else None
        if plain is None or not plain.get("hidden"):
            continue
        saved_ms, a2a_ms = 1000 * (plain["step_s"] - r["step_s"]), plain["hidden"]["a2a_ms"]
        print(f"{name}: step {1000 * r['step_s']:.1f} ms vs {plain['layout']} {1000 * plain['step_s']:.1f} ms: saves {saved_ms:.1f} ms "
              f"= {100 * saved_ms / a2a_ms:.0f}% of {plain['layout']}'s {a2a_ms:.1f} ms of all-to-all kernels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="dp1,dp2,tp2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--model", default="llama3-8b", help="preset: llama3-8b, or deepseek-v2-lite (layer 0 dense, the rest MoE)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--weak", action="store_true", help="global batch x data-parallel size (weak scaling)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trace-dir", default="", help="keep rank 0's profiled step of each layout there as a Chrome trace")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.layout = args.worker
        worker(args)
        return
    rows = []
    for layout in args.layouts.split(","):
        nproc = LAYOUT_FLAGS[layout][0]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
               "--worker", layout, "--layers", str(args.layers), "--seq-length", str(args.seq_length),
               "--global-batch", str(args.global_batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--model", args.model, "--micro-batch-size", str(args.micro_batch_size)] + (["--weak"] if args.weak else []) \
            + (["--trace-dir", os.path.abspath(args.trace_dir)] if args.trace_dir else [])
        result = run_child(cmd, layout)
        if result is not None:
            rows.append(result)
    if not rows:
        return
    base = next((r for r in rows if r["layout"] == "dp1"), None)
    print(f"\nB5: {args.model} x {args.layers} layers, micro batch {args.micro_batch_size}, seq {args.seq_length}, global batch {args.global_batch}{' x dp (weak scaling)' if args.weak else ''}, bf16, {rows[0]['device']}")
    print(f"{'layout':<7} {'GPUs':>4} {'tok/s/GPU':>10} {'TFLOP/s/GPU':>11} {'vs dp1':>7} {'peak GiB':>9} {'comm s':>7} {'hidden':>15} {'a2a hidden':>15} {'bubble':>13}  losses")
    for r in rows:
        per_gpu = r["global_batch"] * args.seq_length / r["step_s"] / r["world"]
        tflops = per_gpu * r["flops_per_token"] / 1e12
        ratio = f"{per_gpu / (base['global_batch'] * args.seq_length / base['step_s']):.3f}" if base else "-"
        hidden = f"{100 * r['hidden']['fraction']:.0f}% of {r['hidden']['nccl_ms']:.0f}ms" if r.get("hidden") else "-"
        a2a = r["hidden"]["a2a_ms"] if r.get("hidden") else 0.0
        a2a_hidden = f"{100 * r['hidden']['a2a_hidden_ms'] / a2a:.0f}% of {a2a:.0f}ms" if a2a else "-"
        comm = f"{r['comm_s']:.3f}" if r["comm_s"] else "-"
        bubble = "-"
        if base and r["pp"] > 1:  # step time over the ideal split of dp1's work, against (pp-1)/(v m)
            measured = r["step_s"] / (base["step_s"] * r["global_batch"] / base["global_batch"] / r["pp"]) - 1
            theory = (r["pp"] - 1) / (r["virtual"] * r["micro_per_rank"])
            modeled = f"{100 * r['modeled_bubble']:.1f}/" if r.get("modeled_bubble") is not None else ""
            bubble = f"{100 * measured:.1f}/{modeled}{100 * theory:.1f}% {r['split']}"
        losses = " ".join(f"{x:.4f}" for x in r["losses"][:4])
        print(f"{r['layout']:<7} {r['world']:>4} {per_gpu:>10,.0f} {tflops:>11.1f} {ratio:>7} {r['peak_gib']:>9.1f} {comm:>7} {hidden:>15} {a2a_hidden:>15} {bubble:>13}  {losses}")
    _print_overlap_gains(rows)
    dp2 = next((r for r in rows if r["layout"] == "dp2"), None)
    if dp2:  # the tensor-parallel target is per GPU against data parallelism on as many GPUs
        per_gpu = {r["layout"]: r["global_batch"] / r["step_s"] / r["world"] for r in rows}
        print("per GPU vs dp2: " + ", ".join(f"{k} {v / per_gpu['dp2']:.3f}" for k, v in per_gpu.items() if k != "dp2"))


if __name__ == "__main__":
    main()
