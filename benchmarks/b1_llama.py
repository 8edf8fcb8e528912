"""B1: the 1.24 B Llama shape, one GPU, meshtron against Hugging Face transformers in one command.

    python benchmarks/b1_llama.py [--steps 10] [--warmup 3] [--micro-batch-size 4] [--seq-length 4096]
        [--sides meshtron,meshtron-ref,hf] [--profile-dir DIR] [-- extra meshtron flags]

Sides: ``meshtron`` (default settings: fused kernels, chunked loss, SDPA backend ``auto``),
``hf``, and meshtron variants (``SIDE_FLAGS``): ``meshtron-ref`` (the reference path),
``meshtron-fp8`` / ``meshtron-fp8-torchao`` (B2: FP8 linears, hybrid format, our
``_scaled_mm`` path with the default recipe, delayed scaling, or torchao's tensorwise one),
``meshtron-fp8-delayed`` / ``-tensorwise`` / ``-rowwise`` (our path per ``--fp8-recipe``), ``meshtron-fp8-head``
(the default recipe with ``--fp8-output-layer``: the output layer's GEMMs in FP8 too),
``-compile`` forms of them (torch.compile per block), and
``meshtron-recompute`` (B7: full activation recompute), ``meshtron-gaf`` (gradient-accumulation fusion),
``meshtron-optref`` (the reference optimizer step instead of the fused one),
``meshtron-no-ce-fusion`` (the per-token chunked loss: logits recomputed in backward). Meshtron sides also report the memory
held between steps (parameters, gradients, optimizer), the peak minus it (activations and
workspaces), and ``meshtron estimate``'s prediction for the same config. With ``--profile-dir``, each meshtron side also profiles two steps after the
timed ones and writes the GPU kernels that took the time to ``DIR/profile_<side>.txt``.

Each side runs in its own process (clean peak-memory numbers), on random tokens, with warm-up
steps left out of the timing; the table printed last is the result. FLOPs per token come from
meshtron's one FLOP-count function for both sides.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from child import report, run_child  # benchmarks/child.py: the child-process protocol

SHAPE = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, rope_base=500000.0)


def time_steps(step, warmup: int, steps: int) -> list[float]:
    """Seconds per step after warm-up: the steps run back to back as in training (no host sync
    between them beyond what a step itself does), timed by CUDA events recorded between them."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for end in events[1:]:
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1000.0 for start, end in zip(events, events[1:])]


_FP8 = ["--fp8-format", "hybrid", "--fp8-backend", "meshtron"]  # the default recipe: delayed
_FP8_TORCHAO = ["--fp8-format", "hybrid", "--fp8-backend", "torchao", "--fp8-recipe", "tensorwise"]
SIDE_FLAGS = {
    "meshtron": [],
    "meshtron-ref": ["--no-fused-kernels", "--attention-backend", "sdpa"],
    "meshtron-compile": ["--compile"],
    "meshtron-fp8": _FP8,
    "meshtron-fp8-compile": _FP8 + ["--compile"],
    "meshtron-fp8-delayed": _FP8 + ["--fp8-recipe", "delayed"],
    "meshtron-fp8-head": _FP8 + ["--fp8-output-layer"],
    "meshtron-fp8-delayed-compile": _FP8 + ["--fp8-recipe", "delayed", "--compile"],
    "meshtron-fp8-tensorwise": _FP8 + ["--fp8-recipe", "tensorwise"],
    "meshtron-fp8-tensorwise-compile": _FP8 + ["--fp8-recipe", "tensorwise", "--compile"],
    "meshtron-fp8-rowwise": _FP8 + ["--fp8-recipe", "rowwise"],
    "meshtron-fp8-rowwise-compile": _FP8 + ["--fp8-recipe", "rowwise", "--compile"],
    "meshtron-fp8-torchao": _FP8_TORCHAO,
    "meshtron-fp8-torchao-compile": _FP8_TORCHAO + ["--compile"],
    "meshtron-recompute": ["--recompute-granularity", "full"],
    "meshtron-gaf": ["--gradient-accumulation-fusion"],
    "meshtron-optref": ["--optimizer-impl", "reference"],
    "meshtron-no-ce-fusion": ["--no-cross-entropy-loss-fusion"],
}


def _idle_gaps(events, top: int = 12) -> tuple[float, list[str]]:
    """The GPU's idle time between consecutive kernels (ms) and the ``top`` longest gaps, each with
    the kernels on either side: where the GPU waited for the host (launches, syncs)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CUDA)
    gaps, busy_until, last = [], None, ""
    for start, end, name in spans:
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, last, name))
        if busy_until is None or end > busy_until:
            busy_until, last = end, name
    lines = [f"{g / 1000:8.3f} ms  after {a[:60]}  before {b[:60]}" for g, a, b in sorted(gaps, reverse=True)[:top]]
    return sum(g for g, _, _ in gaps) / 1000, lines


def profile_steps(step, path: str, trace: str = "") -> float:
    """Two steps under the profiler; the table of GPU time by kernel, the GPU's idle time and its
    longest idle gaps go to ``path``, the timeline to ``trace`` (Chrome trace JSON, gzipped when it
    ends in .gz) if given. Returns the GPU's busy milliseconds over both steps (the kernels' own
    time): well below the steps' wall time means the GPU waited on the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    averages = prof.key_averages()
    busy_ms = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA) / 1000  # kernels, memcpy
    idle_ms, gaps = _idle_gaps(prof.events())
    with open(path, "w") as f:
        f.write(f"GPU busy over the two steps: {busy_ms:.1f} ms; idle between its first and last kernel: {idle_ms:.1f} ms\n")
        f.write("longest idle gaps:\n" + "\n".join(gaps) + "\n")
        f.write(averages.table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90))
    return busy_ms


def run_meshtron(args) -> dict:
    from meshtron.config import build_config
    from meshtron.training.trainer import Trainer

    overrides = [
        "--preset", "llama-1.24b-bench", "--mock-data", "--seq-length", str(args.seq_length),
        "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.micro_batch_size),
        "--train-iters", "1000", "--bf16", "--log-interval", "1000000", "--eval-interval", "0",
        "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "10",
    ] + args.meshtron_args + SIDE_FLAGS[args.child]
    from meshtron.estimate import estimate

    predicted = estimate(build_config(None, overrides)).total_bytes / 2**30
    trainer = Trainer(build_config(None, overrides), log=lambda s: print("[meshtron]", s, file=sys.stderr))
    losses = []

    def step():
        loss, _ = trainer.train_step()
        trainer.iteration += 1
        losses.append(loss)

    times = time_steps(step, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30  # before profiling, whose buffers are not training's
    held = torch.cuda.memory_allocated() / 2**30  # between steps: parameters, gradients, optimizer state
    if args.profile_dir:
        profile_steps(step, f"{args.profile_dir}/profile_{args.child}.txt")
    params = sum(p.numel() for p in trainer.model.parameters())
    return dict(times=times, params=params, first_loss=losses[0], last_loss=losses[-1], peak_gib=peak, held_gib=held, estimate_gib=predicted)


def run_hf(args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["ffn"],
        num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"],
        max_position_embeddings=args.seq_length, rope_theta=SHAPE["rope_base"], tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    losses = []

    def step():
        tokens = torch.randint(0, SHAPE["vocab"], (args.micro_batch_size, args.seq_length), device="cuda", generator=gen)
        out = model(input_ids=tokens, labels=tokens)  # the model shifts labels itself
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.detach())  # read after timing: a training loop logs without a sync per step

    times = time_steps(step, args.warmup, args.steps)
    params = sum(p.numel() for p in model.parameters())
    return dict(times=times, params=params, first_loss=losses[0].item(), last_loss=losses[-1].item())


def child(args) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    result = run_hf(args) if args.child == "hf" else run_meshtron(args)
    result.setdefault("peak_gib", torch.cuda.max_memory_allocated() / 2**30)
    result["device"] = torch.cuda.get_device_name()
    report(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--sides", default="meshtron,hf", help=f"comma-separated: hf, {', '.join(SIDE_FLAGS)}")
    parser.add_argument("--profile-dir", default="", help="profile the meshtron sides into this directory")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("meshtron_args", nargs="*", help="extra meshtron flags after --")
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    from meshtron.models.flops import flops_per_token
    from meshtron.training.metrics import describe_bases, mfu_bases

    rows = {}
    for side in args.sides.split(","):
        cmd = [sys.executable, __file__, "--child", side, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--micro-batch-size", str(args.micro_batch_size), "--seq-length", str(args.seq_length),
               "--profile-dir", args.profile_dir, "--", *args.meshtron_args]
        rows[side] = run_child(cmd, side)

    bases = mfu_bases(torch.device("cuda"))
    tokens_per_step = args.micro_batch_size * args.seq_length
    print(f"\nB1: Llama 1.24B shape, seq {args.seq_length}, micro-batch {args.micro_batch_size}, bf16, median of {args.steps} steps; "
          f"MFU against {describe_bases(bases)}")  # fmt: skip
    base = "hf" if rows.get("hf") else next((s for s, r in rows.items() if r), None)
    mfu_columns = "".join(f" {'MFU/' + b.name:>12}" for b in bases)
    print(f"{'side':<28} {'tokens/s':>10} {'TFLOP/s':>8}{mfu_columns} {'peak GiB':>9} {'held':>6} {'peak-held':>9} "
          f"{'estimate':>8} {'loss first->last':>18} {'vs ' + str(base):>12}")  # fmt: skip
    base_rate = tokens_per_step / statistics.median(rows[base]["times"]) if base else None
    for side, r in rows.items():
        if r is None:
            print(f"{side:<28} failed")
            continue
        rate = tokens_per_step / statistics.median(r["times"])
        tflops = rate * flops_per_token(r["params"], SHAPE["layers"], args.seq_length, SHAPE["hidden"]) / 1e12
        mfu = "".join(f" {f'{100 * tflops / b.tflops:.1f}%' if b.tflops else '-':>12}" for b in bases)
        held, est = r.get("held_gib"), r.get("estimate_gib")
        memory = f"{held:>6.1f} {r['peak_gib'] - held:>9.1f} {est:>8.1f}" if held is not None else f"{'-':>6} {'-':>9} {'-':>8}"
        print(f"{side:<28} {rate:>10,.0f} {tflops:>8.1f}{mfu} {r['peak_gib']:>9.1f} {memory} "
              f"{r['first_loss']:>8.3f}->{r['last_loss']:<8.3f} {rate / base_rate:>11.2f}x")  # fmt: skip
    if any(r is None for r in rows.values()):
        sys.exit(1)  # a side that crashed fails the command, not just its row


if __name__ == "__main__":
    main()
