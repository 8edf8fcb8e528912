"""The host's time for one transformer block: aten ops dispatched, wall time and Python hot spots,
forward and backward, per block kind (a Llama block, DeepSeek-V2-Lite's MLA dense block and its
MLA + MoE block).

    PYTHONPATH=$PWD python benchmarks/host_profile.py                  # the CPU, all three kinds, cut widths
    PYTHONPATH=$PWD python benchmarks/host_profile.py --device cuda --widths preset --tokens 128 --json gpu.json
    PYTHONPATH=$PWD python benchmarks/host_profile.py --kinds moe --top 40 --ops 30   # more detail
    PYTHONPATH=$PWD python benchmarks/host_profile.py --recompute --top 0             # under full recompute
    PYTHONPATH=OLD_TREE python benchmarks/host_profile.py --dump /tmp/old; PYTHONPATH=$PWD ... --dump /tmp/new
    python benchmarks/host_profile.py --compare /tmp/old.moe.pt /tmp/new.moe.pt         # bit for bit

Each block is built the way ``meshtron plan --calibrate`` builds its host measurement
(``planning/calibrate.host_ms_per_block``): the preset's config at one process, cut to one or two
layers, mock data, made by the ``Trainer`` (so the gradient buffer's hooks, gradient-accumulation
fusion and the kernel choices are those of training). The presets keep every count that sets the
number of ops (heads, 64 experts, top-6, the shared experts, the router's rules); ``--widths
small`` (the default) cuts only widths, so the CPU holds the model. One micro batch of
``--tokens`` tokens is fed to the block alone; its backward also takes the block's auxiliary
losses, as training's objective does. ``--recompute`` runs the block inside a non-reentrant
activation checkpoint, as ``--recompute-granularity full`` does (``ModelFamily.forward_blocks``):
its forward still records the graph (saved-tensor hooks drop the tensors), and its backward
reruns the forward first, so the backward's counts hold a second forward.

Printed per kind: aten ops per forward and per backward (a ``TorchDispatchMode`` count; on a GPU
the Triton kernels are not aten ops, so the CUDA launches are counted too, by the profiler), the
median wall time of ``--repeat`` calls, Python function calls, and the top Python functions by
own time (cProfile, per block call; the backward's with autograd's device threads off, so that
its Python runs on the thread cProfile watches). On a GPU "host" is the time to enqueue (no
synchronize inside the timed call) and "synced" includes waiting for the GPU; on the CPU they are
one. ``--dump`` writes each block's outputs and gradients, ``--compare`` checks two dumps (two
trees, same flags and device) for bit-equality.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import time
from typing import Callable, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from meshtron.config import build_config
from meshtron.planning.calibrate import cut_model
from meshtron.training.trainer import Trainer

# Block kind -> (preset, layer pattern of the cut model, index of the block measured). A MoE model
# needs one MoE layer, so its dense block is measured in a model of [dense, MoE].
KINDS = {
    "llama": ("llama3-8b", [0], 0),
    "mla": ("deepseek-v2-lite", [0, 1], 0),
    "moe": ("deepseek-v2-lite", [0, 1], 1),
}
# ``--widths small``: every width cut (the CPU holds 64 experts, and a step's compute stays small
# beside its host time), each still a multiple of 8 that the fused kernels and SDPA's take.
SMALL_WIDTHS = {
    "llama3-8b": ["--hidden-size", "256", "--ffn-hidden-size", "256"],
    "deepseek-v2-lite": ["--hidden-size", "64", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "16",
                         "--moe-shared-expert-intermediate-size", "32", "--kv-lora-rank", "32", "--qk-head-dim", "32",
                         "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32"],
}  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts every aten op that reaches a backend kernel (after autograd), by name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class Block(NamedTuple):
    """One block of a trainer's model, fed a fixed input: its forward (returns the outputs), its
    backward (from those outputs), the gradients' reset, and the gradients by name."""

    forward: Callable[[], list[torch.Tensor]]
    backward: Callable[[list[torch.Tensor]], None]
    zero_grad: Callable[[], None]
    gradients: Callable[[], dict[str, torch.Tensor]]


def build(kind: str, device: str, tokens: int, widths: str, extra: list[str], recompute: bool = False) -> tuple[Trainer, Block]:
    """The trainer of ``kind``'s cut model and its measured block (``recompute``: inside an
    activation checkpoint, as full recompute runs it)."""
    preset, pattern, index = KINDS[kind]
    small = SMALL_WIDTHS[preset] if widths == "small" else []
    cfg = build_config(overrides=["--model.preset", preset, *small, "--device", device, *extra])
    cfg = cut_model(cfg, pattern, tokens)
    trainer = Trainer(cfg, log=lambda _: None)
    model = trainer.model
    batch = model.prepare_batch(trainer._to_device(next(trainer.train_batches)))
    inputs = model.block_inputs(batch)
    with torch.no_grad():
        hidden = model.embed(batch)["hidden"]
    block = list(model.blocks().children())[index]
    x = hidden.detach().requires_grad_()
    grad = torch.randn_like(hidden)

    def forward():
        out = checkpoint(lambda y: block(y, **inputs), x, use_reentrant=False) if recompute else block(x, **inputs)
        aux = list(getattr(block.mlp, "last_aux_losses", {}).values())
        return [out, *aux]

    def backward(outputs):
        torch.autograd.backward(outputs, [grad, *(torch.ones_like(a) for a in outputs[1:])])

    def zero_grad() -> None:
        trainer.optimizer.zero_grad()
        x.grad = None

    def gradients() -> dict[str, torch.Tensor]:
        grads = {f"grad/{name}": p.main_grad.clone() for name, p in block.named_parameters()}
        return {"grad/input": x.grad.clone(), **grads}

    return trainer, Block(forward, backward, zero_grad, gradients)


def dumped(block: Block) -> dict[str, torch.Tensor]:
    """One forward and backward from zero gradients: the outputs and gradients, on the CPU."""
    block.zero_grad()
    outputs = block.forward()
    block.backward(outputs)
    return {**{f"out/{i}": o.detach().cpu() for i, o in enumerate(outputs)}, **{k: v.cpu() for k, v in block.gradients().items()}}


def compare(first: str, second: str) -> bool:
    """Whether two ``--dump`` files hold bit-equal tensors; prints each that differs."""
    a, b = torch.load(first), torch.load(second)
    same = True
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"differs: {key} (in one file only)")
        elif a[key].shape != b[key].shape:
            print(f"differs: {key} (shapes {tuple(a[key].shape)} and {tuple(b[key].shape)})")
        elif not torch.equal(a[key], b[key]):
            print(f"differs: {key} (max abs difference {(a[key].double() - b[key].double()).abs().max().item()})")
        else:
            continue
        same = False
    print(f"{len(a)} tensors: " + ("bit-equal" if same else "NOT bit-equal"))
    return same


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def warm_up(block: Block, calls: int = 3) -> None:
    """First calls probe and cache (the grouped GEMM's backend, Triton's compiles, autotuning)."""
    for _ in range(calls):
        block.zero_grad()
        block.backward(block.forward())


def timed(block: Block, device: str, repeat: int) -> dict[str, float]:
    """Median µs of the forward and backward calls: host (wall time to enqueue), synced (wall time
    to finish on the device), and this thread's CPU time (what other processes' load leaves out;
    on a GPU the backward's runs on autograd's device thread, so only the forward's is given)."""
    times = collections.defaultdict(list)
    for _ in range(repeat):
        block.zero_grad()
        sync(device)
        start, cpu_start = time.perf_counter(), time.thread_time()
        outputs = block.forward()
        enqueued, cpu_enqueued = time.perf_counter(), time.thread_time()
        sync(device)
        done, cpu_done = time.perf_counter(), time.thread_time()
        block.backward(outputs)
        back_enqueued, cpu_back = time.perf_counter(), time.thread_time()
        sync(device)
        back_done = time.perf_counter()
        times["fwd_host_us"].append(enqueued - start)
        times["fwd_synced_us"].append(done - start)
        times["bwd_host_us"].append(back_enqueued - done)
        times["bwd_synced_us"].append(back_done - done)
        times["fwd_thread_cpu_us"].append(cpu_enqueued - cpu_start)
        if device == "cpu":
            times["bwd_thread_cpu_us"].append(cpu_back - cpu_done)
    return {name: 1e6 * statistics.median(values) for name, values in times.items()}


def counted(block: Block) -> tuple[collections.Counter, collections.Counter]:
    block.zero_grad()
    with OpCounter() as fwd:
        outputs = block.forward()
    with OpCounter() as bwd:
        block.backward(outputs)
    return fwd.counts, bwd.counts


def kernel_launches(block: Block) -> tuple[int, int]:
    """CUDA launches per forward and backward: kernels (runtime and driver API: cuBLAS, aten and
    Triton ones), copies and memsets."""
    from torch.profiler import ProfilerActivity, profile

    def launches(fn) -> tuple[int, object]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if any(k in e.name for k in ("LaunchKernel", "Memcpy", "Memset"))), result

    block.zero_grad()
    fwd, outputs = launches(block.forward)
    bwd, _ = launches(lambda: block.backward(outputs))
    return fwd, bwd


def python_profile(block: Block, calls: int) -> tuple[pstats.Stats, pstats.Stats, int, int]:
    """cProfile of ``calls`` forwards and of as many backwards, separately. The backward runs on
    the calling thread (autograd's device threads off), where cProfile sees its Python."""
    fwd_prof, bwd_prof = cProfile.Profile(), cProfile.Profile()
    for _ in range(calls):
        block.zero_grad()
        fwd_prof.enable()
        outputs = block.forward()
        fwd_prof.disable()
        with torch.autograd.set_multithreading_enabled(False):
            bwd_prof.enable()
            block.backward(outputs)
            bwd_prof.disable()
    fwd, bwd = pstats.Stats(fwd_prof), pstats.Stats(bwd_prof)
    return fwd, bwd, fwd.total_calls // calls, bwd.total_calls // calls


def top_functions(stats: pstats.Stats, calls: int, top: int) -> list[str]:
    """The ``top`` functions by own time, per block call: calls, own µs, cumulative µs, where."""
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    lines = [f"    {'calls':>6} {'own us':>8} {'cum us':>8}  function"]
    for (path, line, name), (_, ncalls, own, cum, _) in rows:
        where = name if path == "~" else f"{path.split('site-packages/')[-1].split('hostcut/')[-1]}:{line} {name}"
        lines.append(f"    {ncalls / calls:6.1f} {1e6 * own / calls:8.1f} {1e6 * cum / calls:8.1f}  {where}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--tokens", type=int, default=16, help="tokens of the one micro batch")
    parser.add_argument("--widths", default="small", choices=("small", "preset"), help="cut widths, or the preset's own")
    parser.add_argument("--repeat", type=int, default=50, help="timed calls (median)")
    parser.add_argument("--top", type=int, default=20, help="Python functions listed per pass (0: none)")
    parser.add_argument("--ops", type=int, default=0, help="most frequent aten ops listed per pass")
    parser.add_argument("--recompute", action="store_true", help="the block inside an activation checkpoint (full recompute)")
    parser.add_argument("--json", default="", help="also write the numbers to this file")
    parser.add_argument("--dump", default="", help="write each block's outputs and gradients to DUMP.<kind>.pt")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="only compare two dump files bit for bit")
    parser.add_argument("flags", nargs="*", help="after --: more meshtron train flags (e.g. --fused-kernels off)")
    args = parser.parse_args()
    if args.compare:
        raise SystemExit(0 if compare(*args.compare) else 1)
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # the host's own work is one thread; tiny ops gain nothing from more
    results = {}
    for kind in args.kinds:
        trainer, block = build(kind, args.device, args.tokens, args.widths, args.flags, args.recompute)
        if args.dump:
            torch.save(dumped(block), f"{args.dump}.{kind}.pt")
        warm_up(block)
        fwd_ops, bwd_ops = counted(block)
        row = {"fwd_ops": sum(fwd_ops.values()), "bwd_ops": sum(bwd_ops.values()), **timed(block, args.device, args.repeat)}
        if args.device == "cuda":
            row["fwd_launches"], row["bwd_launches"] = kernel_launches(block)
        fwd_stats, bwd_stats, row["fwd_py_calls"], row["bwd_py_calls"] = python_profile(block, 10)
        results[kind] = row
        print(f"== {kind}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()), flush=True)
        for name, ops, stats in (("forward", fwd_ops, fwd_stats), ("backward", bwd_ops, bwd_stats)):
            if args.ops:
                print(f"  {name} aten ops: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(args.ops)))
            if args.top:
                print(f"  {name}, Python by own time per block call:")
                print("\n".join(top_functions(stats, 10, args.top)))
        del trainer, block
    print(f"\n| block ({args.device}) | fwd ops | bwd ops | fwd host us | bwd host us | fwd synced us | bwd synced us | fwd thread CPU us |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind, r in results.items():
        print(f"| {kind} | {r['fwd_ops']} | {r['bwd_ops']} | {r['fwd_host_us']:.0f} | {r['bwd_host_us']:.0f} | "
              f"{r['fwd_synced_us']:.0f} | {r['bwd_synced_us']:.0f} | {r['fwd_thread_cpu_us']:.0f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
