"""Every Triton kernel meshtron launches, compiled ahead of time for the GPUs it runs on (sm90,
gfx942, gfx90a, gfx950 of ``platform.TARGETS``) on a machine without any GPU:

    python -m meshtron.kernels.compile_check [--targets sm90,gfx942] [--verbose]

Why: nothing here has an AMD GPU, so that every kernel builds for AMD, within AMD's 64 KiB of LDS,
must be proven by compiling. Triton's wheel carries both vendors' code generators and linkers.

How: the launchers run on small CPU tensors with the kernels on while ``JITFunction.run`` and
``Autotuner.run`` only record their arguments (nothing executes: outputs are left uninitialized,
which no launcher reads on the host). ``_launch_everything`` makes each launcher's calls in the
dtypes and variants the library uses on that target (its FP8 family; the TMA kernel on Hopper).
Each recorded launch is then specialized by the target's own binder, exactly as Triton's launcher
does (ints equal to 1 become constants, multiples of 16 and aligned pointers get divisibility
hints), and compiled with ``triton.compile``; an autotuned launch in every tile its prune hook
keeps for the target. It fails when a kernel does not compile, a kernel needs more shared memory
(LDS) than the target has, no tile of an autotuned launch fits, or a kernel defined in
``meshtron/kernels`` was never launched here (a new launcher not yet listed).

Compiled kernels go to Triton's cache (``TRITON_CACHE_DIR``), keyed by the kernel's source hash,
the target and the options: a CI job that keeps that directory recompiles only changed kernels.
A CI job that starts clean reads ``--record FILE`` instead (the suite's is
``tests/data/triton_aot_record.json``): the shared memory each launch needed when it last compiled,
keyed by the Triton version, the target, the kernel's source hash (with its dependencies') and the
launch's specialization and options. A launch found there is not compiled again; any change to a
kernel, its launch or Triton misses the record and compiles. ``--update-record`` rewrites the file
with this run's launches (commit it with a kernel change, so CI stays fast).
Must run without ``TRITON_INTERPRET`` (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from unittest import mock

import torch

from meshtron.kernels import platform



@dataclass
class Launch:
    kernel: object  # the JITFunction
    args: tuple
    kwargs: dict
    tuner: object | None  # the Autotuner it went through, if any


@dataclass
class Compiled:
    kernel: str
    target: str
    configs: int  # tiles tried (1 for a kernel that is not autotuned)
    fitting: int  # of which fit the target's shared memory
    shared: int  # the largest shared memory (bytes) of those that fit


class CompileRecord:
    """Shared-memory bytes of launches compiled before, by key (see the module's docstring); what
    this run looked up or compiled is kept, so ``save`` writes exactly the launches in use."""

    def __init__(self, path: str = "") -> None:
        self.path, self.known, self.used, self.compiled = path, {}, {}, 0
        if path and os.path.exists(path):
            with open(path) as f:
                self.known = json.load(f)

    def shared(self, key: str, compile_now) -> int:
        if key not in self.known:
            self.known[key] = compile_now()
            self.compiled += 1
        self.used[key] = self.known[key]
        return self.used[key]

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(dict(sorted(self.used.items())), f, indent=0)
            f.write("\n")


@contextlib.contextmanager
def recording(launches: list[Launch]):
    """Launches append to ``launches`` instead of running."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs, None))

    def tuned_run(self, *args, grid=None, warmup=False, **kwargs):
        launches.append(Launch(self.fn, args, kwargs, self))

    with mock.patch.object(JITFunction, "run", run), mock.patch.object(Autotuner, "run", tuned_run):
        yield


def _grad(out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)


def _launch_everything(target: platform.Target) -> None:
    """Every launcher of the library, in the variants it launches on ``target``, on CPU tensors."""
    from meshtron.kernels import fp8, fused_adamw, triton_grouped_gemm as gg, triton_moe_permute as perm
    from meshtron.kernels.bias_gelu import bias_gelu
    from meshtron.kernels.cross_entropy import linear_cross_entropy
    from meshtron.kernels.cross_entropy_sum import linear_cross_entropy_sum
    from meshtron.kernels.dropout_add import dropout_add
    from meshtron.kernels.fp8_scaling import FP8_FAMILIES, FP8_RECIPES, Fp8Recipe, Fp8Scaling, gemm_multiple, recipe_formats
    from meshtron.kernels.norms import layer_norm, rms_norm
    from meshtron.kernels.rope import apply_rotary
    from meshtron.kernels.swiglu import swiglu
    from meshtron.kernels.triton_mla import MlaQueryKey
    from meshtron.kernels.triton_pointwise import scale_into, split_in_three
    from meshtron.layers.moe.router import _fused_routing
    from meshtron.layers.moe.balancing import statistics_needed
    from meshtron.layers.moe.fp8_grouped_gemm import quantize_rows, quantize_weights

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape).to(dtype).requires_grad_(dtype.is_floating_point)

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, w = rand(64, 96, dtype=dtype), rand(96, dtype=dtype)
        _grad(rms_norm(x, w, 1e-5, "on"), [x, w])
        _grad(layer_norm(x, w, rand(96, dtype=dtype), 1e-5, "on"), [x, w])
        h = rand(2, 16, 160, dtype=dtype)
        _grad(swiglu(h, "on"), [h])
        fc1_bias = rand(160, dtype=dtype)
        for approximate in ("none", "tanh"):
            _grad(bias_gelu(h, fc1_bias, approximate, "on"), [h, fc1_bias])
        _grad(dropout_add(x, rand(64, 96, dtype=dtype), 0.1, True, "on"), [x])
        qkv, cos, sin = rand(2, 16, 4, 64, dtype=dtype), torch.randn(32, 64), torch.randn(32, 64)
        for positions in (None, torch.randint(0, 32, (2, 16))):
            _grad(apply_rotary(qkv, cos, sin, positions, "on"), [qkv])
        hidden, vocab = rand(2, 16, 64, dtype=dtype), rand(1000, 64, dtype=dtype)
        _grad(linear_cross_entropy(hidden, vocab, torch.randint(0, 1000, (2, 16)), "on", 256), [hidden, vocab])
        a, weight, offsets = rand(96, 64, dtype=dtype), rand(4, 128, 64, dtype=dtype), gg.group_offsets(torch.tensor([30, 0, 50, 16]))
        _grad(gg.TritonGroupedMM.apply(a, weight, offsets), [a, weight])
        main_grad = torch.zeros(4, 128, 64)
        gg.group_weight_grad(torch.randn(96, 128).to(dtype), a.detach(), offsets, 4, out=main_grad, accumulate=True)
        if _tma(target) and dtype != torch.float32:
            for b in (weight.detach().transpose(1, 2), weight.detach()[:, :64].contiguous()):
                gg.rows_times_group_tma(a.detach(), b, offsets, programs=4)
        tokens, inverse = rand(24, 64, dtype=dtype), torch.randperm(48).view(24, 2)
        rows = perm.permute_copies(tokens, inverse)
        for experts in (8, 64, 256):  # blocks of 128, 128 and 32 copies
            perm.plan_rows(torch.randint(0, experts, (300, 6)), experts)
        _grad(perm.combine_copies(rows, torch.rand(24, 2, requires_grad=True), inverse, dtype), [rows, tokens])
        q, kv, k_rope = rand(2, 8, 4, 96, dtype=dtype), rand(2, 8, 4, 128, dtype=dtype), rand(2, 8, 32, dtype=dtype)
        for positions in (None, torch.randint(0, 8, (2, 8))):
            q_out, k_out, _ = MlaQueryKey.apply(q, kv, k_rope, torch.randn(8, 32), torch.randn(8, 32), positions)
            _grad(q_out.sum() + k_out.sum(), [q, kv, k_rope])
        for k, experts, softmax, pre, balancing, z in ((2, 8, True, False, "aux_loss", 0.1), (6, 64, True, True, "seq_aux_loss", 0.0),
                                                       (8, 256, False, False, "aux_loss", 0.0), (1, 5, False, False, "none", 0.0)):  # fmt: skip
            logits = rand(256, experts, dtype=dtype)  # two sequences of whole programs (FusedRouting)
            needed = statistics_needed(balancing, 1.0, z)
            rows = 2 if balancing == "seq_aux_loss" else 1
            probs, _, stats, _ = _fused_routing(logits, k, softmax, pre, 1.0, rows, needed)
            _grad(probs.float().sum() + sum(v.float().sum() for v in stats.values() if v.requires_grad), [logits])
            probs, _, _, losses = _fused_routing(logits, k, softmax, pre, 1.0, rows, needed, (1.0, z))
            _grad(probs.float().sum() + sum(losses.values(), torch.zeros(())), [logits])
        flat = torch.randn(10000).to(dtype)
        split_in_three(torch.randn(96, 64))
        scale_into(torch.zeros(10000), flat, torch.ones(()), accumulate=True)
        scale_into(torch.zeros(10000), flat, torch.ones(()), accumulate=False)
        fused_adamw.sum_of_squares([flat, flat[:100]])
        for moments, model in ((torch.float32, flat), (dtype, None)):
            index = torch.zeros(10000, dtype=torch.uint8)
            fused_adamw.fused_adamw(flat, torch.randn(10000), torch.zeros(10000, dtype=moments), torch.zeros(10000, dtype=moments),
                                    model.clone() if model is not None else None, index, fused_adamw.block_groups(index),
                                    coef=torch.ones(()), decay=[0.9, 1.0], step=1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)  # fmt: skip
    if _has_fp8(target):
        family = "fnuz" if target.arch in platform.FNUZ_FP8_ARCHS else "ocp"
        for recipe in FP8_RECIPES:
            for fmt in recipe_formats(recipe):
                blocks = gemm_multiple(recipe) // 16  # blockwise: whole 128 x 128 tiles
                x, w = rand(48 * blocks, 64 * blocks, dtype=torch.bfloat16), rand(32 * blocks, 64 * blocks, dtype=torch.bfloat16)
                scaling = Fp8Scaling(Fp8Recipe(fmt, recipe, fused_kernels="on"), family=family)
                _grad(fp8.linear(x, w, None, scaling), [x, w])
        hidden, head = rand(32, 64, dtype=torch.bfloat16), rand(256, 64, dtype=torch.bfloat16)  # --fp8-output-layer: the gradient's cast
        head_scaling = Fp8Scaling(Fp8Recipe("hybrid", "delayed", fused_kernels="on"), family=family)
        _grad(linear_cross_entropy_sum(hidden, head, torch.randint(0, 256, (32,)), torch.ones(32), "on", fp8=head_scaling), [hidden, head])
        experts = torch.randn(3, 80, 48).to(torch.bfloat16)  # FP8 experts' casts: weights (both copies, rows only), rows
        for transposed in (True, False):
            quantize_weights(experts, FP8_FAMILIES[family][0], True, transposed, "on")
        quantize_rows(experts[0], FP8_FAMILIES[family][0], "on")


def _has_fp8(target: platform.Target) -> bool:
    """Whether FP8 runs on ``target`` (refused on gfx90a: ``platform.fp8_refusal``)."""
    return target.backend == "cuda" or target.arch in platform.FNUZ_FP8_ARCHS + platform.OCP_FP8_AMD_ARCHS


def _tma(target: platform.Target) -> bool:
    """Whether the grouped GEMM's TMA kernel runs on ``target`` (``tma_rows_usable``: NVIDIA Hopper and later)."""
    return target.backend == "cuda" and target.arch >= 90


def launched_kernels(target: platform.Target) -> list[Launch]:
    launches: list[Launch] = []
    with recording(launches), mock.patch.object(platform, "target", lambda device=None: target):
        _launch_everything(target)
    return launches


def _defined_kernels() -> set[str]:
    """Every @triton.jit function of ``meshtron/kernels`` not called from another kernel: what must be launched."""
    import importlib
    from pathlib import Path

    from triton.runtime.jit import JITFunction

    kernels = {}  # "module.name" -> (name, source)
    modules = [p.stem for p in sorted(Path(__file__).parent.glob("*.py")) if "@triton.jit" in p.read_text() and p.stem != "compile_check"]
    for name in modules:
        module = importlib.import_module(f"meshtron.kernels.{name}")
        for attr, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                kernels[f"{name}.{attr}"] = (attr, value.src)
    called = {key for key, (attr, _) in kernels.items() if any(f"{attr}(" in src for other, (_, src) in kernels.items() if other != key)}
    return set(kernels) - called


def _kernel_name(kernel) -> str:
    return f"{kernel.fn.__module__.rsplit('.', 1)[-1]}.{kernel.fn.__name__}"


def _compile(launch: Launch, target: platform.Target, config, record: CompileRecord) -> int:
    """Compile one launch (in ``config``'s tile, if autotuned) for ``target``, unless ``record``
    knows it; its shared memory in bytes."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, kwargs = launch.kernel, dict(launch.kwargs)
    if config is not None:
        kwargs.update(config.all_kwargs())
    kwargs.setdefault("debug", False)
    kwargs.setdefault("instrumentation_mode", knobs.compilation.instrumentation_mode)
    kwargs.setdefault("fpsan_homomorphic_casts", knobs.compilation.fpsan_homomorphic_casts)
    gpu = GPUTarget(target.backend, target.arch, target.warp_size)
    backend = make_backend(gpu)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    described = repr((triton.__version__, target.backend, target.arch, target.warp_size, kernel.cache_key, signature,
                      sorted(constexprs.items()), sorted(attrs.items()), sorted(options.__dict__.items())))  # fmt: skip
    key = f"{_kernel_name(kernel)}:{target.arch}:{hashlib.sha256(described.encode()).hexdigest()[:32]}"

    def compile_now() -> int:
        return compile(ASTSource(kernel, signature, constexprs, attrs), target=gpu, options=options.__dict__).metadata.shared

    return record.shared(key, compile_now)


def compile_for(target_name: str, verbose: bool = False, record: CompileRecord | None = None) -> tuple[list[Compiled], list[str]]:
    """Every launch of ``target_name``'s variants compiled (or found in ``record``) -> (what compiled, the failures)."""
    record = record or CompileRecord()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launcher's default, said explicitly (silences a warning)
    target = platform.TARGETS[target_name]
    launches, results, failures = launched_kernels(target), {}, []
    for launch in launches:
        name = _kernel_name(launch.kernel)
        configs = [None]
        if launch.tuner is not None:
            tuner = launch.tuner
            nargs = dict(zip(tuner.arg_names, launch.args))
            configs = tuner.configs
            if tuner.early_config_prune:
                with mock.patch.object(platform, "target", lambda device=None: target):
                    configs = tuner.early_config_prune(tuner.configs, nargs, **launch.kwargs)
        shared = []
        for config in configs:
            try:
                shared.append(_compile(launch, target, config, record))
            except Exception as e:  # noqa: BLE001 - every failure is reported with its kernel and target
                failures.append(f"{name} on {target_name} ({config}): {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        fitting = [s for s in shared if s <= target.shared_bytes]
        if shared and not fitting:
            failures.append(f"{name} on {target_name}: no tile fits {target.shared_bytes // 1024} KiB of shared memory "
                            f"(smallest {min(shared) // 1024} KiB)")  # fmt: skip
        if launch.tuner is None and shared and shared[0] > target.shared_bytes:
            failures.append(f"{name} on {target_name}: {shared[0] // 1024} KiB of shared memory, over {target.shared_bytes // 1024} KiB")
        previous = results.get(name)
        entry = Compiled(name, target_name, len(configs), len(fitting), max(fitting, default=0))
        if previous:
            entry = Compiled(name, target_name, previous.configs + entry.configs, previous.fitting + entry.fitting,
                             max(previous.shared, entry.shared))  # fmt: skip
        results[name] = entry
        if verbose:
            print(f"  {name} on {target_name}: {len(fitting)}/{len(configs)} fit", flush=True)
    missing = _defined_kernels() - set(results)
    missing -= set() if _tma(target) else {"triton_grouped_gemm._rows_tma_kernel"}
    missing -= set() if _has_fp8(target) else {"triton_fp8_cast._cast_kernel", "triton_fp8_blockwise._block_cast_kernel",
                                               "triton_fp8_blockwise._block_mm_kernel", "triton_fp8_grouped._amax_kernel",
                                               "triton_fp8_grouped._cast_kernel", "triton_fp8_grouped._rows_kernel"}  # fmt: skip
    failures += [f"{name}: defined but never launched by compile_check._launch_everything (add its launcher)" for name in sorted(missing)]
    return list(results.values()), failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(platform.TARGETS), help=f"comma-separated, of {', '.join(platform.TARGETS)}")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--record", default="", help="a JSON file of earlier compiles' results: launches found there are not compiled again")
    parser.add_argument("--update-record", action="store_true", help="rewrite --record with this run's launches")
    args = parser.parse_args(argv)
    if args.update_record and not args.record:
        parser.error("--update-record needs --record FILE")
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    all_failures, record = [], CompileRecord(args.record)
    for name in args.targets.split(","):
        start, before = time.perf_counter(), record.compiled
        compiled, failures = compile_for(name, args.verbose, record)
        all_failures += failures
        tiles = sum(c.configs for c in compiled)
        print(f"{name}: {len(compiled)} kernels, {tiles} compiled configurations ({record.compiled - before} compiled now, "
              f"the rest found in the record), {len(failures)} failures, {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
        for c in sorted(compiled, key=lambda c: c.kernel):
            print(f"  {c.kernel:<48} {c.fitting:>3}/{c.configs:<3} fit, largest that fits {c.shared / 1024:6.1f} KiB")
    for failure in all_failures:
        print("FAIL", failure)
    if args.update_record and not all_failures:
        record.save()
    return 1 if all_failures else 0


if __name__ == "__main__":
    sys.exit(main())
