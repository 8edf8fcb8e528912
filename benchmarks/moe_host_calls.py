"""B4's MoE layer, its host calls counted per part: aten ops, Triton launches and autograd nodes,
forward and backward, and the host's time per part.

    PYTHONPATH=$PWD python benchmarks/moe_host_calls.py                                   # GPU, B4's shape
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/moe_host_calls.py --device cpu   # the GPU's path, counted on the CPU
    PYTHONPATH=OLD_TREE python benchmarks/moe_host_calls.py ...                           # another tree's ``meshtron``

The layer is ``b4_moe_layer.py``'s (64 experts top-6, 2 shared, softmax router in fp32 with the
balancing loss, bf16, dropless). Its forward is cut into parts by what ``MoELayer.forward`` calls:
the router module, the balancing loss (``losses_from_statistics``), the dispatch plan
(``plan_dispatch``), ``permute``, the routed and the shared experts, and the combine
(``unpermute``); ops outside them are "layer (other)". A part's backward is the autograd nodes its
forward created (found by walking the graph from its outputs, stopping at the inputs'). A name
the tree's layer module lacks is skipped, so trees whose layer calls other functions compare by
the parts they share: since the router makes the losses itself (2026-11-28) the balancing loss
counts in the router's row, and in a separate row for older trees.

Printed per part: aten ops (a ``TorchDispatchMode`` count, the interpreter's own ops left out),
Triton launches and autograd nodes, forward and backward; then, from ``--repeat`` calls without
the counter, the median host µs per part (wall time; on a GPU the time to enqueue, not the
GPU's). The backward runs on the calling thread (autograd's device threads off) so its parts can
be timed between its nodes. On the CPU without ``--fused-kernels off`` the Triton kernels run
under the interpreter (``TRITON_INTERPRET=1``), which makes their µs meaningless; the counts are
the GPU path's, except the fp32 gate's backward, whose CUDA-only mm is emulated by more ops.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import KernelInterface

import meshtron.layers.moe.layer as layer_module
from b4_moe_layer import DEEPSEEK_V2_LITE, b4_config
from meshtron.layers.moe import MoELayer

# (part, how MoELayer.forward reaches it): a submodule of the layer, or a function of its module.
PARTS = [
    ("router", "router"),
    ("balancing loss", "losses_from_statistics"),
    ("dispatch plan", "plan_dispatch"),
    ("permute", "permute"),
    ("routed experts", "experts"),
    ("shared experts", "shared_experts"),
    ("combine", "unpermute"),
]
OTHER = "layer (other)"
# ``--widths small``: the counts kept (experts, top-k, shared), the widths cut, for the CPU.
SMALL = dict(hidden_size=64, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=32)


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in a call's arguments or result (tuples, lists, dicts, dataclasses)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        value = list(value.values())
    elif not isinstance(value, (tuple, list)):
        return []
    return [t for v in value for t in tensors_in(v)]


class Parts:
    """Which part runs now (a stack: the shared experts run inside the experts' call), which part
    created each autograd node, and per part: aten ops, Triton launches, nodes, µs."""

    def __init__(self):
        self.stack = [OTHER]
        self.node_part: dict[torch.autograd.graph.Node, str] = {}
        self.hooked: set[torch.autograd.graph.Node] = set()  # a leaf's node outlives a step: hooked once
        self.counts = collections.defaultdict(collections.Counter)  # (pass, part) -> {"ops", "launches", "nodes"}
        self.times = collections.defaultdict(float)  # (pass, part) -> seconds
        self.pass_name = "fwd"
        self.in_kernel = False
        self.last = time.perf_counter()

    def switch(self, part: str) -> None:
        """Charge the time since the last switch to the part that ran, then run ``part``."""
        now = time.perf_counter()
        self.times[(self.pass_name, self.stack[-1])] += now - self.last
        self.last = now
        self.stack[-1] = part

    def claim(self, tensors: list[torch.Tensor], part: str) -> None:
        """Mark the unclaimed autograd nodes behind ``tensors`` as ``part``'s."""
        todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in self.node_part:
                continue
            self.node_part[node] = part
            self.counts[("fwd", part)]["nodes"] += 1
            if node not in self.hooked:
                self.hooked.add(node)
                node.register_prehook(self._backward_prehook(node))
            todo.extend(child for child, _ in node.next_functions)

    def _backward_prehook(self, node):
        def prehook(grad_outputs):
            part = self.node_part.get(node, OTHER)
            self.switch(part)
            self.counts[("bwd", part)]["nodes"] += 1

        return prehook

    def enter(self, part: str, args) -> None:
        self.claim(tensors_in(args), OTHER)
        self.switch(self.stack[-1])
        self.stack.append(part)

    def leave(self, part: str, result) -> None:
        self.claim(tensors_in(result), part)
        self.switch(part)
        self.stack.pop()


def instrument(layer: MoELayer, parts: Parts) -> None:
    """Wrap the layer's submodules and its module's functions named in ``PARTS``."""
    for part, name in PARTS:
        target = getattr(layer, name, None)
        if isinstance(target, torch.nn.Module):
            target.register_forward_pre_hook(lambda _m, args, kwargs, part=part: parts.enter(part, (args, kwargs)), with_kwargs=True)
            target.register_forward_hook(lambda _m, _args, result, part=part: parts.leave(part, result))
        elif hasattr(layer_module, name):
            function = getattr(layer_module, name)

            def wrapped(*args, _function=function, _part=part, **kwargs):
                parts.enter(_part, (args, kwargs))
                result = _function(*args, **kwargs)
                parts.leave(_part, result)
                return result

            setattr(layer_module, name, wrapped)


class Counter(TorchDispatchMode):
    """aten ops per part; Triton launches are counted by ``count_launches``, whose kernels'
    interpreted ops (on the CPU) are not the host's."""

    def __init__(self, parts: Parts):
        super().__init__()
        self.parts = parts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.parts.in_kernel:
            counts = self.parts.counts[(self.parts.pass_name, self.parts.stack[-1])]
            counts["ops"] += 1
            counts[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_launches(parts: Parts):
    """Count each ``kernel[grid](...)`` (JIT, autotuned or interpreted) as one launch of the running part."""
    original = KernelInterface.__getitem__

    def getitem(kernel, grid):
        launch = original(kernel, grid)

        def run(*args, **kwargs):
            parts.counts[(parts.pass_name, parts.stack[-1])]["launches"] += 1
            parts.in_kernel, outer = True, parts.in_kernel
            try:
                return launch(*args, **kwargs)
            finally:
                parts.in_kernel = outer

        return run

    KernelInterface.__getitem__ = getitem
    try:
        yield
    finally:
        KernelInterface.__getitem__ = original


def step(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor, parts: Parts, sync) -> None:
    """One forward and backward of the layer (its output and its auxiliary losses), parts marked."""
    x.grad = None
    layer.zero_grad(set_to_none=True)
    parts.pass_name, parts.stack, parts.last = "fwd", [OTHER], time.perf_counter()
    out = layer(x)
    losses = list(layer.last_aux_losses.values())
    parts.claim([out, *losses], OTHER)
    parts.switch(OTHER)
    sync()
    parts.pass_name, parts.last = "bwd", time.perf_counter()
    with torch.autograd.set_multithreading_enabled(False):
        torch.autograd.backward([out, *losses], [grad, *(torch.ones_like(loss) for loss in losses)])
    parts.switch(OTHER)
    sync()
    parts.node_part.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tokens", type=int, default=0, help="default: 8192 on a GPU, 256 on the CPU")
    parser.add_argument("--widths", default="", choices=("", "preset", "small"), help="default: preset on a GPU, small on the CPU")
    parser.add_argument("--fused-kernels", default="", help="model.fused_kernels; default: auto on a GPU, on on the CPU")
    parser.add_argument("--repeat", type=int, default=20, help="timed steps (median)")
    parser.add_argument("--ops", action="store_true", help="also list each part's aten ops by name")
    parser.add_argument("--json", default="", help="also write the numbers to this file")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    tokens = args.tokens or (8192 if gpu else 256)
    widths = {} if (args.widths or ("preset" if gpu else "small")) == "preset" else SMALL
    cfg = b4_config(fused_kernels=args.fused_kernels or ("auto" if gpu else "on"), **{**DEEPSEEK_V2_LITE, **widths})
    torch.manual_seed(0)
    layer = MoELayer(cfg).to(args.device, torch.bfloat16)
    x = torch.randn(1, tokens, cfg.hidden_size, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    parts = Parts()
    instrument(layer, parts)
    with count_launches(parts):
        for _ in range(3):  # compiles, autotuning, the grouped GEMM's probes
            step(layer, x, grad, parts, sync)
        parts.counts.clear()
        with Counter(parts):
            step(layer, x, grad, parts, sync)
    counts = {key: dict(value) for key, value in parts.counts.items()}
    runs = []
    for _ in range(args.repeat):
        parts.times.clear()
        step(layer, x, grad, parts, sync)
        runs.append(dict(parts.times))
    names = [part for part, _ in PARTS] + [OTHER]
    rows = {}
    for part in names:
        row = {f"{p}_{what}": counts.get((p, part), {}).get(what, 0) for p in ("fwd", "bwd") for what in ("ops", "launches", "nodes")}
        for p in ("fwd", "bwd"):
            row[f"{p}_host_us"] = 1e6 * statistics.median(run.get((p, part), 0.0) for run in runs)
        if any(row.values()):
            rows[part] = row
    rows["total"] = {key: sum(row[key] for row in rows.values()) for key in next(iter(rows.values()))}
    where = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"{where}: {tokens} tokens, hidden {cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.moe_router_topk}, "
          f"fused kernels {cfg.fused_kernels}; host µs: median of {args.repeat} steps")  # fmt: skip
    print("| part | fwd ops | fwd launches | fwd nodes | bwd ops | bwd launches | bwd nodes | fwd host µs | bwd host µs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for part, r in rows.items():
        print(f"| {part} | {r['fwd_ops']} | {r['fwd_launches']} | {r['fwd_nodes']} | {r['bwd_ops']} | {r['bwd_launches']} | "
              f"{r['bwd_nodes']} | {r['fwd_host_us']:.0f} | {r['bwd_host_us']:.0f} |")  # fmt: skip
    if args.ops:
        for (p, part), c in sorted(counts.items()):
            print(f"{p} {part}: " + ", ".join(f"{op[5:]} {n}" for op, n in sorted(c.items()) if op.startswith("aten.")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
