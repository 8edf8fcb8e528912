"""Context parallelism on long sequences: kernels, correctness across GPUs, training throughput and
the longest sequence that fits.

    python benchmarks/cp_long_context.py [--nproc 2] [--seqs 32768,ring:131072] [--variants cp1,ring,allgather/flash]
        [--ladder cp1:262144,ring:262144] [--attn-seqs 32768,65536,131072] [--budget 280]

Phases, each one ``torchrun`` launch of ``--nproc`` processes (one per GPU of this host):

- ``check``: (a) ring and all-gather attention at cp = nproc with each fused block kernel
  (flash, cuDNN) against full-sequence attention (fp32 SDPA on the whole sequence, computed on
  every rank), bf16, Llama-3-8B attention shapes (32 heads, 8 kv heads, d 128); (b) one block's
  forward + backward with each kernel and with the fp32 math path; (c) one attention layer's
  forward + backward at each ``--attn-seqs``: cp 1 (SDPA as the model runs it: cuDNN first)
  against cp = nproc, ring and all-gather, each block kernel.
- ``train`` (one launch per variant, so that an out-of-memory ends only its own ladder):
  ``meshtron.training.Trainer`` on mock tokens with the Llama-3-8B layer shapes but ``--layers``
  layers (4 by default) + the 128 K vocabulary, micro batch 1, bf16 with fp32 master weights,
  fused kernels, full activation recompute, the distributed optimizer. ``cp1`` is data
  parallelism (each GPU one whole sequence, global batch nproc); ``ring`` and ``allgather`` are
  cp = nproc (one sequence over all GPUs, global batch 1), with the ``auto`` block kernel (cuDNN) or
  the one named after a slash (``ring/flash``). Tokens/s/GPU and model TFLOP/s/GPU (``6 P + 6 L S h`` per token, recompute not
  counted) from the median of ``--steps`` timed steps after ``--warmup``; the sequence lengths
  of ``--seqs`` then those of the ``--ladder`` (one timed step each), ascending, until one does
  not fit.

Out of memory: the rank prints an ``OOM`` line and exits at once; torchrun then stops the other
ranks (which may wait in a collective), and the ladder of that variant ends there. Every phase
runs under what is left of ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial

OOM_EXIT = 17
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _emit(kind: str, **fields) -> None:
    print(f"{kind} " + json.dumps(fields), flush=True)


def _timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up (GPU synchronized)."""
    import torch

    fn()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# ---------------------------------------------------------------------- phase: check
# What (b) and (c) time: forward + backward of one block or one attention layer.


def _kernel_block(kern, q, k, v, diagonal: bool, scale: float) -> None:
    out, lse, aux = kern.forward(q, k, v, diagonal, scale)
    kern.backward(out, q, k, v, out, lse, aux, diagonal, scale)


def _math_block(math, q5, kv, block) -> None:
    out, lse = math.forward(q5, kv, block)
    math.backward((q5, q5, lse, (q5 * out).sum(-1)), kv, block)


def _sdpa_layer(q, k, v) -> None:
    import torch
    import torch.nn.functional as F

    from meshtron.layers.attention import sdpa_backends

    with sdpa_backends("auto", q.device):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(torch.ones_like(out))


def _cp_layer(fn, local, mesh, kernel) -> None:
    import torch

    out = fn(*local, mesh, kernel=kernel)
    out.backward(torch.ones_like(out))


def check_worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from meshtron.parallel import context_parallel as cp
    from meshtron.parallel import cp_block_kernels
    from meshtron.parallel.mesh import Mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = Mesh(cp=world, rank=rank)
    mesh.init_process_groups()
    say = _emit if rank == 0 else (lambda *a, **k: None)
    if rank == 0:
        for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                   "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"):  # fmt: skip
            print("SCHEMA", getattr(torch.ops.aten, op).default._schema, flush=True)
    fns = {"ring": cp.ring_attention, "allgather": cp.allgather_kv_attention}
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()

    # (a) correctness across the ranks against the whole sequence
    seq = args.check_seq
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, seq, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, seq, KV_HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16() for _ in range(2))
    dout = torch.randn(1, seq, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
    full = [t.float().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in full), is_causal=True, enable_gqa=True).transpose(1, 2)
    want_grads = torch.autograd.grad(want, full, dout.float())
    index = cp.cp_token_index(seq, world, rank, q.device)
    for kernel in args.kernels:
        for name, fn in fns.items():
            try:
                local = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
                got = fn(*local, mesh, kernel=kernel)
                grads = torch.autograd.grad(got, local, dout[:, index])
                errs = [rel(got, want[:, index])] + [rel(a, b[:, index]) for a, b in zip(grads, want_grads)]
                worst = torch.tensor(max(errs), device="cuda")
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                say("CHECK", kernel=kernel, algorithm=name, cp=world, seq=seq, out=errs[0], dq=errs[1], dk=errs[2], dv=errs[3], worst_any_rank=worst.item())
            except Exception as e:  # noqa: BLE001 - a kernel the installed torch refuses is a result to report
                say("CHECK", kernel=kernel, algorithm=name, cp=world, seq=seq, error=f"{type(e).__name__}: {str(e)[:300]}")
    del full, want, want_grads

    # (b) one block, forward + backward, each implementation
    scale = HEAD_DIM**-0.5
    for size in args.block_sizes:
        qb = torch.randn(1, HEADS, size, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        kb, vb = (torch.randn(1, KV_HEADS, size, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for diagonal in (True, False):
            flops = 4 * size * size * HEADS * HEAD_DIM * 3.5 * (0.5 if diagonal else 1.0)
            impls = {name: kern for name, kern in cp_block_kernels.BLOCK_KERNELS.items() if name in args.kernels}
            for name, kern in impls.items():
                try:
                    s = _timed(partial(_kernel_block, kern, qb, kb, vb, diagonal, scale), 3)
                    say("BLOCK", impl=name, size=size, diagonal=diagonal, ms=1e3 * s, tflops=flops / s / 1e12)
                except Exception as e:  # noqa: BLE001
                    say("BLOCK", impl=name, size=size, diagonal=diagonal, error=f"{type(e).__name__}: {str(e)[:200]}")
            if size <= args.math_max:
                math = cp._MathBlocks(KV_HEADS, scale, None, 0)
                q5, kv = math.layout(qb.transpose(1, 2)), torch.stack([kb, vb]).transpose(2, 3)
                s = _timed(partial(_math_block, math, q5, kv, cp._Block(slice(None), slice(None), diagonal)), 2)
                say("BLOCK", impl="math-fp32", size=size, diagonal=diagonal, ms=1e3 * s, tflops=flops / s / 1e12)
        del qb, kb, vb
        torch.cuda.empty_cache()

    # (c) one attention layer, forward + backward: cp 1 SDPA against cp = world
    for seq in args.attn_seqs:
        flops = 4 * seq * seq * HEADS * HEAD_DIM * 3.5 * 0.5
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(1, seq, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(1, seq, KV_HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16() for _ in range(2))
        q1, k1, v1 = (t.transpose(1, 2).requires_grad_() for t in (q, k, v))
        try:
            s = _timed(partial(_sdpa_layer, q1, k1, v1), 2)
            say("LAYER", impl="cp1-sdpa-auto", seq=seq, ms=1e3 * s, tflops_per_gpu=flops / s / 1e12)
        except torch.OutOfMemoryError:
            say("LAYER", impl="cp1-sdpa-auto", seq=seq, error="OOM")
        index = cp.cp_token_index(seq, world, rank, q.device)
        local = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
        del q1, k1, v1
        for kernel in args.kernels:
            for name, fn in fns.items():
                try:
                    s = torch.tensor(_timed(partial(_cp_layer, fn, local, mesh, kernel), 2), device="cuda")
                    dist.all_reduce(s, op=dist.ReduceOp.MAX)
                    say("LAYER", impl=f"cp{world}-{name}-{kernel}", seq=seq, ms=1e3 * s.item(), tflops_per_gpu=flops / world / s.item() / 1e12)
                except Exception as e:  # noqa: BLE001
                    say("LAYER", impl=f"cp{world}-{name}-{kernel}", seq=seq, error=f"{type(e).__name__}: {str(e)[:200]}")
        del q, k, v, local
        torch.cuda.empty_cache()
    dist.destroy_process_group()


# ---------------------------------------------------------------------- phase: train


def _model_flags(args) -> list[str]:
    if args.tiny:  # a CPU smoke test of this script: the same path, a model of a few kB
        return ["--preset", "llama3-8b", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--num-query-groups", "2", "--ffn-hidden-size", "128", "--vocab-size", "256", "--fp32"]  # fmt: skip
    return ["--preset", "llama3-8b", "--num-layers", str(args.layers), "--bf16"]


def train_worker(args) -> None:
    import gc

    import torch

    from meshtron.config import build_config
    from meshtron.training.trainer import Trainer

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    variant = args.variant
    algorithm, _, kernel = variant.partition("/")
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    seqs = args.seqs.get("*", []) + args.seqs.get(variant, [])
    rungs = [(s, args.warmup, args.steps) for s in seqs] + [(s, 0, 1) for s in args.ladder.get(variant, [])]
    for seq, warmup, steps in rungs:
        flags = _model_flags(args) + [
            "--mock-data", "--seq-length", str(seq), "--micro-batch-size", "1", "--train-iters", "1000",
            "--log-interval", "1000000", "--eval-interval", "0", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "2",
            "--recompute-granularity", "full", "--use-distributed-optimizer",
        ]  # fmt: skip
        if algorithm == "cp1":
            flags += ["--global-batch-size", str(world)]
        else:  # the ring's block kernel follows --attention-backend where it names one of its kernels
            flags += ["--global-batch-size", "1", "--context-parallel-size", str(world),
                      "--cp-comm-type", "p2p" if algorithm == "ring" else "all_gather"] + (["--attention-backend", kernel] if kernel else [])  # fmt: skip
        try:
            trainer = Trainer(build_config(None, flags), log=lambda s: None)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times, losses = [], []
            for step in range(warmup + steps):
                sync()
                start = time.perf_counter()
                loss, _ = trainer.train_step()
                sync()
                trainer.iteration += 1
                losses.append(loss)
                if step >= warmup:
                    times.append(time.perf_counter() - start)
        except torch.OutOfMemoryError:
            print(f"OOM {json.dumps({'variant': variant, 'seq': seq, 'rank': rank})}", flush=True)
            os._exit(OOM_EXIT)
        if rank == 0:
            tokens_per_gpu = seq * (1 if algorithm == "cp1" else 1 / world)
            step_s = statistics.median(times)
            _emit("RESULT", variant=variant, seq=seq, world=world, step_s=step_s, timed_steps=steps, warmup=warmup,
                  tokens_per_s_gpu=tokens_per_gpu / step_s, tflops_gpu=tokens_per_gpu / step_s * trainer.flops_per_token / 1e12,
                  peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                  losses=losses, device=torch.cuda.get_device_name() if cuda else "cpu")  # fmt: skip
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------- driver


def _launch(args, phase: str, extra: list[str], deadline: float) -> tuple[list[str], int | None]:
    """One torchrun launch of this file's ``phase``; its stdout lines, and its exit code (None: timed out)."""
    budget = deadline - time.monotonic()
    if budget < 20:
        print(f"[{phase} {' '.join(extra)}] skipped: {budget:.0f} s of the budget left", flush=True)
        return [], None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", __file__,
           "--phase", phase] + extra + _shared(args)  # fmt: skip
    print(f"$ {' '.join(cmd[3:])}  (timeout {budget:.0f} s)", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, check=False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(f"  timed out after {budget:.0f} s", flush=True)
        return out.splitlines(), None
    if proc.returncode not in (0, OOM_EXIT) and "OOM " not in proc.stdout:
        sys.stdout.write(proc.stderr[-4000:])
    for line in proc.stdout.splitlines():
        print("  " + line, flush=True)
    return proc.stdout.splitlines(), proc.returncode


def _shared(args) -> list[str]:
    return ["--layers", str(args.layers), "--seqs", _unparse(args.seqs), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--kernels", ",".join(args.kernels), "--check-seq", str(args.check_seq),
            "--block-sizes", ",".join(map(str, args.block_sizes)), "--attn-seqs", ",".join(map(str, args.attn_seqs)),
            "--math-max", str(args.math_max), "--ladder", _unparse(args.ladder)] + (["--tiny"] if args.tiny else [])  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _per_variant(text: str) -> dict[str, list[int]]:
    """``variant:seq,...`` (a bare ``seq``: every variant) -> {variant or "*": [seq, ...]}."""
    out: dict[str, list[int]] = {}
    for item in filter(None, text.split(",")):
        name, _, seq = item.rpartition(":")
        out.setdefault(name or "*", []).append(int(seq))
    return out


def _unparse(per_variant: dict[str, list[int]]) -> str:
    return ",".join(f"{k}:{s}" if k != "*" else str(s) for k, v in per_variant.items() for s in v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--phases", default="check,train")
    parser.add_argument("--variants", default="cp1,ring,allgather")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seqs", type=_per_variant, default=_per_variant("32768,65536"), help="seq or variant:seq, ...")
    parser.add_argument("--ladder", type=_per_variant, default={}, help="variant:seq,... tried after --seqs, one step each")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--kernels", type=lambda s: s.split(","), default=["flash", "cudnn"])
    parser.add_argument("--check-seq", type=int, default=8192)
    parser.add_argument("--block-sizes", type=_ints, default=_ints("4096,16384"))
    parser.add_argument("--math-max", type=int, default=4096, help="largest block the fp32 math path is timed at")
    parser.add_argument("--attn-seqs", type=_ints, default=_ints("32768,65536,131072"))
    parser.add_argument("--budget", type=float, default=280.0, help="seconds for all phases together")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "check":
        check_worker(args)
        return
    if args.phase == "train":
        train_worker(args)
        return
    deadline = time.monotonic() + args.budget
    lines: list[str] = []
    phases = args.phases.split(",")
    if "check" in phases:
        lines += _launch(args, "check", [], deadline)[0]
    if "train" in phases:
        for variant in args.variants.split(","):
            lines += _launch(args, "train", ["--variant", variant], deadline)[0]
    report(lines, args)


def report(lines: list[str], args) -> None:
    """The final tables, from the launches' output."""
    parsed = [(l.split(" ", 1)[0], json.loads(l.split(" ", 1)[1])) for l in lines if l.split(" ", 1)[0] in ("CHECK", "BLOCK", "LAYER", "RESULT", "OOM")]
    by = lambda kind: [r for k, r in parsed if k == kind]
    if by("CHECK"):
        print("\n(a) cp attention vs whole-sequence fp32 SDPA, bf16, norm-wise relative error (worst over ranks)")
        for r in by("CHECK"):
            print(f"  {r['algorithm']:<9} {r['kernel']:<6} cp{r['cp']} seq {r['seq']}: " + (r["error"] if "error" in r else
                  f"out {r['out']:.2e} dq {r['dq']:.2e} dk {r['dk']:.2e} dv {r['dv']:.2e} (worst {r['worst_any_rank']:.2e})"))  # fmt: skip
    if by("BLOCK"):
        print("\n(b) one block, forward + backward (32 heads, 8 kv heads, d 128, bf16)")
        for r in by("BLOCK"):
            shape = f"{r['size']}x{r['size']} {'causal' if r['diagonal'] else 'full  '}"
            print(f"  {r['impl']:<10} {shape}: " + (r["error"] if "error" in r else f"{r['ms']:8.2f} ms {r['tflops']:6.1f} TFLOP/s"))
    if by("LAYER"):
        print("\n(c) one causal attention layer, forward + backward, per-GPU TFLOP/s (cp N: the slowest rank's time)")
        for r in by("LAYER"):
            print(f"  seq {r['seq']:>7} {r['impl']:<22}: " + (r["error"] if "error" in r else f"{r['ms']:9.1f} ms {r['tflops_per_gpu']:6.1f} TFLOP/s/GPU"))
    results, ooms = by("RESULT"), by("OOM")
    if results or ooms:
        print(f"\n(b, c) training through meshtron.training.Trainer: Llama-3-8B layer shapes x {args.layers} layers + 128K vocab, "
              f"micro batch 1, bf16, full recompute, {args.nproc} GPUs ({results[0]['device'] if results else '?'})")  # fmt: skip
        print(f"  {'variant':<16} {'seq':>8} {'tok/s/GPU':>10} {'TFLOP/s/GPU':>11} {'step s':>7} {'peak GiB':>9}  losses")
        for r in results:
            losses = " ".join(f"{x:.4f}" for x in r["losses"][:3])
            note = "  (ladder: one step, no warm-up)" if not r["warmup"] else ""
            print(f"  {r['variant']:<16} {r['seq']:>8} {r['tokens_per_s_gpu']:>10,.0f} {r['tflops_gpu']:>11.1f} {r['step_s']:>7.2f} {r['peak_gib']:>9.1f}  {losses}{note}")
        fits: dict[str, int] = {}
        for r in results:
            fits[r["variant"]] = max(fits.get(r["variant"], 0), r["seq"])
        oom_at = {r["variant"]: r["seq"] for r in ooms}
        for variant in args.variants.split(","):
            print(f"  longest that ran, {variant}: {fits.get(variant, 'none')}" + (f"; out of memory at {oom_at[variant]}" if variant in oom_at else ""))


if __name__ == "__main__":
    main()
