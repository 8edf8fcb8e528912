"""Muon on the GPU: its step-time overhead at the B1 shape, and its loss against AdamW on real text.

    python benchmarks/muon_check.py [--out DIR] [--steps 10] [--accumulate 8]
        [--loss-steps 300] [--adam-lrs 1e-3,3e-3] [--muon-lrs 3e-4,1e-3,3e-3] [--parts speed,loss]

speed: the B1 model (``llama-1.24b-bench``: 1.24 B, seq 4096, micro-batch 4, bf16 with fp32
masters), AdamW (its fused step, the default) and Muon (``--optimizer muon``,
Megatron-Core's defaults: Newton-Schulz in bf16, 5 quintic steps, spectral scale), each timed
over ``--steps`` training steps after warm-up (CUDA events, median), at B1's global batch (one
micro batch) and at ``--accumulate`` micro batches per step (Muon's work is per step, so its
share falls as the batch grows); plus the optimizer step alone (median of ``--steps`` calls).
The overhead is Muon's step time over AdamW's, minus one. Below the table: Newton-Schulz's GEMM
FLOPs per step and the rate at which Muon's extra optimizer time (over AdamW's) would run them
(a lower bound on the GEMMs' rate: that time holds the rest of Muon's work too).

loss: a small Llama-style model (8 blocks, h512) on the embedded corpus (real text, byte-level
BPE), the same seed, data order and tokens for every run (``--loss-steps`` steps of 16 x 512
tokens), AdamW and Muon each at a few peak learning rates (warm-up then cosine to a tenth); the
table gives the training loss (mean of the last 20 steps) and the final validation loss.

Each timed configuration and the loss part run in their own child process; the tables are printed last and written to
``DIR/muon_check.md`` (and the raw numbers to ``DIR/muon_check.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys

import torch
from b1_llama import time_steps  # benchmarks/: the B1 timing loop (CUDA events between steps)
from child import report, run_child  # benchmarks/child.py: the child-process protocol

B1 = ["--preset", "llama-1.24b-bench", "--mock-data", "--seq-length", "4096", "--micro-batch-size", "4", "--train-iters", "1000",
      "--bf16", "--log-interval", "1000000", "--eval-interval", "0", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "10"]  # fmt: skip
SMALL = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--num-query-groups", "4", "--ffn-hidden-size", "1408",
         "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--seq-length", "512", "--micro-batch-size", "16", "--global-batch-size", "16",
         "--bf16", "--eval-iters", "20", "--log-interval", "1000000", "--weight-decay", "0.1", "--clip-grad", "1.0"]  # fmt: skip


def _trainer(flags: list[str]):
    from meshtron.config import build_config
    from meshtron.training.trainer import Trainer

    return Trainer(build_config(None, flags), log=lambda s: print("[meshtron]", s, file=sys.stderr))


def speed(args) -> dict:
    """Median step and optimizer-step seconds at B1 of ``args.optimizer`` at ``args.micro`` micro batches a step."""
    trainer = _trainer(B1 + ["--global-batch-size", str(4 * args.micro), "--optimizer", args.optimizer])

    def step():
        trainer.train_step()
        trainer.iteration += 1

    times = time_steps(step, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    optimizer_times = time_steps(lambda: trainer.optimizer.step(1e-5), 1, args.steps)  # on the last step's gradients
    muon = trainer.optimizer.rules.get("muon")
    return {"step": statistics.median(times), "optimizer": statistics.median(optimizer_times), "peak_gib": peak,
            "ns_flops": newton_schulz_flops(muon) if muon is not None else 0}  # fmt: skip


def newton_schulz_flops(muon) -> int:
    """GEMM FLOPs of one Muon step's Newton-Schulz: per block (short side s, long side l) and
    iteration, the Gram matrix (2 s^2 l), its square (2 s^3) and the update of X (2 s^2 l)."""
    from meshtron.optim.muon_batch import row_count

    steps, total = muon.settings.num_ns_steps, 0
    for group in muon.param_groups:
        for master in group["params"]:
            *lead, rows, cols = master.shape
            for block in muon.plans[id(master)].blocks or [slice(None)]:
                s, l = sorted((row_count(block, rows), cols))
                total += math.prod(lead) * steps * (4 * s * s * l + 2 * s**3)
    return total


def loss(args) -> dict:
    """Final training and validation losses of each (optimizer, lr) run at equal tokens."""
    out = {}
    runs = [("adam", lr) for lr in args.adam_lrs.split(",")] + [("muon", lr) for lr in args.muon_lrs.split(",")]
    for optimizer, lr in runs:
        flags = SMALL + ["--optimizer", optimizer, "--lr", lr, "--min-lr", str(float(lr) / 10), "--lr-warmup-iters", str(args.loss_steps // 10),
                         "--train-iters", str(args.loss_steps), "--eval-interval", str(args.loss_steps), "--seed", "1234"]  # fmt: skip
        result = _trainer(flags).run()
        out[f"{optimizer} lr {lr}"] = {"train": sum(result.losses[-20:]) / len(result.losses[-20:]), "valid": result.valid_losses[-1][1]}
        gc.collect()
        torch.cuda.empty_cache()
    return out


def tables(args, results: dict) -> str:
    lines = [f"# Muon check ({results.get('device', '?')})", ""]
    s = results.get("speed")
    if s:
        lines += [f"## Step time, B1 shape (1.24 B, seq 4096, micro-batch 4, bf16), median of {args.steps} steps", "",
                  "| micro batches | AdamW step ms | Muon step ms | overhead | AdamW optimizer ms | Muon optimizer ms | AdamW peak GiB | Muon peak GiB |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for micro in (1, args.accumulate):
            a, m = s.get(f"adam x{micro}"), s.get(f"muon x{micro}")
            if a is None or m is None:
                lines.append(f"| {micro} | failed |")
                continue
            lines.append(f"| {micro} | {1000 * a['step']:.1f} | {1000 * m['step']:.1f} | {100 * (m['step'] / a['step'] - 1):+.1f} % | "
                         f"{1000 * a['optimizer']:.1f} | {1000 * m['optimizer']:.1f} | {a['peak_gib']:.1f} | {m['peak_gib']:.1f} |")  # fmt: skip
        if (m := s.get("muon x1")) and (a := s.get("adam x1")) and m["optimizer"] > a["optimizer"]:
            extra = m["optimizer"] - a["optimizer"]
            lines += ["", f"Newton-Schulz: {m['ns_flops']:.3g} GEMM FLOPs a step; Muon's optimizer step over AdamW's "
                      f"({1000 * extra:.1f} ms) runs them at {m['ns_flops'] / extra / 1e12:.0f} TFLOP/s"]  # fmt: skip
        lines.append("")
    losses = results.get("loss")
    if losses:
        lines += [f"## Loss on the embedded corpus, {args.loss_steps} steps x 16 x 512 tokens (equal tokens), 8 x h512 Llama-style", "",
                  "| run | train loss (last 20) | validation loss |", "| --- | --- | --- |"]  # fmt: skip
        lines += [f"| {run} | {r['train']:.4f} | {r['valid']:.4f} |" for run, r in losses.items()]
        best = {opt: min((r["valid"], run) for run, r in losses.items() if run.startswith(opt)) for opt in ("adam", "muon")}
        lines += ["", f"best validation: AdamW {best['adam'][0]:.4f} ({best['adam'][1]}), Muon {best['muon'][0]:.4f} ({best['muon'][1]}); "
                  f"Muon / AdamW {best['muon'][0] / best['adam'][0]:.4f}"]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="muon_check_out")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=8)
    parser.add_argument("--loss-steps", type=int, default=300)
    parser.add_argument("--adam-lrs", default="1e-3,3e-3")
    parser.add_argument("--muon-lrs", default="3e-4,1e-3,3e-3")
    parser.add_argument("--parts", default="speed,loss")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", default="adam", help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.backends.cuda.matmul.allow_tf32 = True
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        report({"result": speed(args) if args.child == "speed" else loss(args), "device": device})
        return
    results: dict = {}
    children = [("speed", f"{optimizer} x{micro}", ["--optimizer", optimizer, "--micro", str(micro)])
                for micro in (1, args.accumulate) for optimizer in ("adam", "muon") if "speed" in args.parts]
    children += [("loss", "loss", [])] if "loss" in args.parts else []
    for part, name, extra in children:  # each in its own process: clean peak memory, nothing left over from the last
        shared = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("child", "optimizer", "micro")]
        out = run_child([sys.executable, __file__, "--child", part, *shared, *extra], name)
        if out is not None:
            results["device"] = out["device"]
            results.setdefault(part, {}).update({name: out["result"]} if part == "speed" else out["result"])
    text = tables(args, results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "muon_check.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "muon_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n" + text)
    if len(results.get("speed", {})) + ("loss" in results) < len(children):
        sys.exit(1)  # a child that crashed fails the command


if __name__ == "__main__":
    main()
