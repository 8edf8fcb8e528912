"""B2's accuracy half: the same training run in bf16 and with FP8 linears, on real text.

    python benchmarks/b2_fp8_loss.py [--steps 200] [--seeds 1,2,3] [--fp8-recipe delayed]
        [--fp8-backend meshtron] [--sides bf16,fp8,fp8_head] [-- extra meshtron flags]

Per seed, both runs share the seed, data order and config (the embedded corpus with its
byte-level BPE tokenizer, a Llama-style model of 8 blocks at h2048); the table gives the
training loss (mean of 10 steps) at a few points and the validation loss at the end, FP8 against
bf16, and the last lines the final losses' ratio per seed (one early instability can move one
seed's ratio by percents). Each run is its own process so none sees another's compiled or cached state.
Sides: ``bf16``, ``fp8`` (the blocks' linears) and ``fp8_head`` (also the output layer,
``--fp8-output-layer``); each FP8 side is set against bf16.
"""

from __future__ import annotations

import argparse
import sys

from child import report, run_child  # benchmarks/child.py: the child-process protocol

MODEL = [
    "--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--num-query-groups", "4",
    "--ffn-hidden-size", "5632", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--seq-length", "1024", "--micro-batch-size", "8", "--global-batch-size", "8",
    "--lr", "6e-4", "--min-lr", "6e-5", "--lr-warmup-iters", "20", "--bf16", "--eval-iters", "10",
]  # fmt: skip


def child(args) -> None:
    from meshtron.config import build_config
    from meshtron.training.trainer import Trainer

    flags = MODEL + ["--train-iters", str(args.steps), "--eval-interval", str(args.steps), "--log-interval", "50",
                     "--seed", str(args.seeds)]  # fmt: skip
    if args.child != "bf16":
        flags += ["--fp8-format", args.fp8_format, "--fp8-backend", args.fp8_backend, "--fp8-recipe", args.fp8_recipe]
    if args.child == "fp8_head":
        flags.append("--fp8-output-layer")
    result = Trainer(build_config(None, flags + args.extra), log=lambda s: print(s, file=sys.stderr)).run()
    report({"losses": result.losses, "valid": result.valid_losses[-1][1]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fp8-format", default="hybrid")
    parser.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "rowwise", "blockwise"])
    parser.add_argument("--fp8-backend", default="meshtron")
    parser.add_argument("--seeds", default="1234", help="comma-separated seeds, one bf16 and one FP8 run each")
    parser.add_argument("--sides", default="bf16,fp8", help="comma-separated: bf16 (always run), fp8, fp8_head")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="extra meshtron flags after --")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sides = ["bf16"] + [s for s in args.sides.split(",") if s != "bf16"]
    unknown = set(sides) - {"bf16", "fp8", "fp8_head"}
    if unknown:
        parser.error(f"--sides: unknown {sorted(unknown)}; choose from bf16, fp8, fp8_head")
    ratios = {}
    for seed in args.seeds.split(","):
        runs = {}
        for side in sides:
            cmd = [sys.executable, __file__, "--child", side, "--steps", str(args.steps), "--seeds", seed, "--fp8-format",
                   args.fp8_format, "--fp8-recipe", args.fp8_recipe, "--fp8-backend", args.fp8_backend, "--", *args.extra]  # fmt: skip
            runs[side] = run_child(cmd, f"{side} seed {seed}")
        if not all(runs.values()):
            print(f"seed {seed}: a run failed:", {k: v is not None for k, v in runs.items()})
            continue
        for side in sides[1:]:
            ratios.setdefault(side, {})[seed] = print_table(args, seed, runs, side)
    for side, per_seed in ratios.items():
        print(f"\n{side} {args.fp8_recipe} / bf16, per seed: final training loss (mean of the last 10 steps), validation loss:")
        for seed, (final, valid) in per_seed.items():
            print(f"  seed {seed}: {final:.4f} {valid:.4f}")


def print_table(args, seed: str, runs: dict, side: str) -> tuple[float, float]:
    """The seed's table of ``side`` against bf16; returns its final training-loss and validation-loss ratios."""
    points = sorted({min(args.steps, p) for p in (10, 50, 100, 150, args.steps)})
    print(f"\nB2 loss: embedded corpus, {args.steps} steps of 8 x 1024 tokens, seed {seed}, "
          f"{side} {args.fp8_format} {args.fp8_recipe} ({args.fp8_backend}) vs bf16")  # fmt: skip
    print(f"{'step':>6} {'bf16':>8} {side:>8} {'ratio':>9}")
    for p in points:
        b, f = (sum(runs[s]["losses"][p - 10 : p]) / 10 for s in ("bf16", side))
        print(f"{p:>6} {b:>8.4f} {f:>8.4f} {f / b:>9.4f}")
    b, f = runs["bf16"]["valid"], runs[side]["valid"]
    print(f"{'valid':>6} {b:>8.4f} {f:>8.4f} {f / b:>9.4f}")
    return sum(runs[side]["losses"][-10:]) / sum(runs["bf16"]["losses"][-10:]), f / b


if __name__ == "__main__":
    main()
