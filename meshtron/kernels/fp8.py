"""FP8 linear layers for training: e4m3 forward, e5m2 ("hybrid") or e4m3 gradients (the OCP
formats, or the fnuz ones on AMD gfx942: ``fp8_scaling.FP8_FAMILIES``), scaled by
one of the recipes of ``meshtron.kernels.fp8_scaling`` (delayed, tensorwise, rowwise, blockwise), on
``torch._scaled_mm`` (blockwise: ``meshtron.kernels.fp8_blockwise``'s GEMMs); or torchao's
``convert_to_float8_training`` (tensorwise only) when installed.

Why FP8: an H100 runs e4m3 GEMMs at ~1.8x its bf16 rate (1369 vs 762 TFLOP/s, BENCHMARKS.md).
The weights stay bf16 with fp32 masters in the optimizer, exactly as without FP8; only the three
GEMMs of each linear (forward, grad of input, grad of weight) read FP8 copies made on the fly.
Each operand is cast once per layout it is used in by ``meshtron.kernels.fp8_cast`` (one Triton
pass writes both the row-major and the transposed copy on GPUs), so no GEMM needs a transposed
copy of its own; the forward saves only the transposed copies the backward reads (1 byte each).

Weights across micro batches: inside ``step_cache``'s scope (the runner opens it around a step of
several micro batches, where no weight changes) a weight is cast once, at its first forward with
grad, in both layouts, and every later micro batch and every recomputed forward of the step reads
those copies (``_weight_copies``), as Transformer Engine's ``is_first_microbatch`` does (B3's
blocks hold 1.74 G weight elements, read and cast again by each micro batch otherwise). The copies
stay until the step ends, 2 bytes per weight element (``meshtron estimate`` counts them). Every
recipe's weight copies are a function of the weight alone, except delayed scaling's, which read
the weight's amax history: the step's copies carry the scale its first micro batch reads (as a
cast per micro batch does there), while casting again would scale the later micro batches from the
amax the first one pushed (the same value unless the last optimizer step moved the weight's
amax). The history's weight row gets one entry a step instead of one per micro batch (the same
amax each time), so for weights ``--fp8-amax-history-len`` counts steps. Blocks under
``torch.compile`` cast per micro batch: a lookup keyed by parameter, traced, guards the compiled
code on the cache's keys, so every block would compile again.

``_scaled_mm`` wants every GEMM dimension a multiple of 16 and its second operand column-major
(blockwise: multiples of 128, the block); a layer whose features are not such multiples, or a call
whose token count is not, runs the plain bf16 ``F.linear`` instead.

Tensor parallelism: the parallel linears of ``meshtron.parallel.tensor_parallel`` call
``linear`` below with their ``fp8`` scaling state, so a sharded layer runs the same function on
its shard (with its own amax histories: each rank scales its shard).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.kernels import deferred_wgrad, platform, step_cache
from meshtron.kernels.fp8_blockwise import block_mm
from meshtron.kernels.fp8_cast import Quantized
from meshtron.kernels.fp8_scaling import (
    Fp8Recipe,
    Fp8Scaling,
    gemm_multiple,
    grad_dtype,
    platform_family,
)
from meshtron.kernels.linear_swap import replace_linears, with_parameters_of


def _mm(scaling: Fp8Scaling, a: torch.Tensor, a_inv: torch.Tensor, b_t: torch.Tensor, b_inv: torch.Tensor,
        out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``(a * a_inv) @ (b_t * b_inv)^T`` for row-major FP8 ``a`` [M, K] and ``b_t`` [N, K]; inverse
    scales 0-d, per row ([M, 1] and [N, 1]), or per block (``scaling``'s recipe blockwise).

    ``_scaled_mm`` takes its second operand column-major: ``b_t.t()`` is exactly that view of a
    row-major [N, K] tensor, and its per-row scales become the [1, N] per-column ones. ``out``:
    written in place (tensor-wise scales only, ``_fp32_scaled_mm_out``).
    """
    if scaling.recipe.recipe == "blockwise":
        return block_mm(a, a_inv, b_t, b_inv, out_dtype, scaling.recipe.fused_kernels)
    if b_inv.ndim:
        a_inv, b_inv = a_inv.reshape(-1, 1), b_inv.reshape(1, -1)
    if out is not None:
        return torch._scaled_mm(a, b_t.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, out=out)
    return torch._scaled_mm(a, b_t.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


@functools.cache
def _fp32_scaled_mm_out(device: torch.device) -> bool:
    """Whether this build's tensor-wise ``_scaled_mm`` writes an fp32 result into a given ``out``
    here (probed once on a 16 x 16 GEMM: the builds and GPUs differ)."""
    ones = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    out, scale = torch.zeros(16, 16, device=device), torch.ones((), device=device)
    try:
        torch._scaled_mm(ones, ones.t(), scale_a=scale, scale_b=scale, out_dtype=torch.float32, out=out)
    except (RuntimeError, NotImplementedError):
        return False
    return bool((out == 16.0).all())


def _weight_grad_into_main_grad(param: torch.Tensor, scaling: Fp8Scaling, g_t: torch.Tensor, g_inv: torch.Tensor,
                                x_t: torch.Tensor, x_inv: torch.Tensor) -> None:  # fmt: skip
    """Gradient-accumulation fusion for an FP8 linear: the weight gradient ``g^T @ x`` into
    ``param.main_grad`` (now, or in a zero-bubble schedule's ``W``). Its step's first gradient is
    the GEMM's fp32 output written in place (tensor-wise scales, where the build takes it: no bf16
    rounding, no copy); a later one, or a recipe with row or block scales, is a product in the
    weight's dtype added (as the gradient buffer's hook would)."""
    main_grad = param.main_grad
    tensorwise = scaling.recipe.recipe != "blockwise" and g_inv.ndim == 0

    def wgrad(overwrite: bool) -> None:
        if overwrite and tensorwise and main_grad.dtype == torch.float32 and _fp32_scaled_mm_out(main_grad.device):
            _mm(scaling, g_t, g_inv, x_t, x_inv, main_grad.dtype, out=main_grad)
            return
        product = _mm(scaling, g_t, g_inv, x_t, x_inv, main_grad.dtype if tensorwise else param.dtype)
        main_grad.copy_(product) if overwrite else main_grad.add_(product)

    deferred_wgrad.defer_or_run(param, wgrad)


def _weight_copies(weight: torch.Tensor, scaling: Fp8Scaling, transposed: bool, seeded: bool, update: bool) -> Quantized:
    """The weight's FP8 copies: made once a step (both layouts, read by every micro batch and
    recomputed forward) by a forward with grad (``update``) where ``step_cache`` keeps them, else
    those this call needs. An evaluation forward never leaves a copy lacking the transposed layout."""

    def cast(with_transposed: bool) -> Quantized:
        return scaling.quantize(weight, "weight", True, with_transposed, seeded, update)

    if update and not torch.compiler.is_compiling() and step_cache.keeps(weight):
        return step_cache.derived(weight, f"fp8 linear {id(scaling)}", lambda: cast(True))
    return cast(transposed)


class _Fp8Linear(torch.autograd.Function):
    """y = x w^T with all three GEMMs in FP8 (bias added outside, in the input's dtype).

    Forward casts x and w row-major for its GEMM and transposed for the backward's (saved; w's
    copies once a step where ``_weight_copies`` keeps them);
    backward casts the output gradient both ways: grad_x = g @ w reads g's rows and w's
    transposed copy, grad_w = g^T @ x reads both transposed copies. ``into_main_grad``: grad_w goes
    into ``weight.main_grad`` (``_weight_grad_into_main_grad``), autograd gets none.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scaling: Fp8Scaling, seeded: bool, update: bool,
                into_main_grad: bool) -> torch.Tensor:  # fmt: skip
        x2 = x.reshape(-1, x.shape[-1])
        need_x_grad, need_w_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        xq = scaling.quantize(x2, "input", True, need_w_grad, seeded, update)
        wq = _weight_copies(weight, scaling, need_x_grad, seeded, update)
        ctx.save_for_backward(xq.transposed, xq.transposed_inv, wq.transposed, wq.transposed_inv)
        ctx.scaling, ctx.seeded, ctx.update = scaling, seeded, update
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.param = weight if into_main_grad else None  # the parameter itself: it holds main_grad
        return _mm(scaling, xq.rows, xq.rows_inv, wq.rows, wq.rows_inv, x.dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xt, xt_inv, wt, wt_inv = ctx.saved_tensors
        need_x_grad, need_w_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g2 = grad.reshape(-1, grad.shape[-1])
        gq = ctx.scaling.quantize(g2, "grad", need_x_grad, need_w_grad, ctx.seeded, ctx.update)
        grad_x = grad_w = None
        if need_x_grad:  # [M, K] = g [M, N] @ w [N, K]: w^T [K, N] is the second operand
            grad_x = _mm(ctx.scaling, gq.rows, gq.rows_inv, wt, wt_inv, ctx.x_dtype).view(*grad.shape[:-1], wt.shape[0])
        if need_w_grad and ctx.param is not None:
            _weight_grad_into_main_grad(ctx.param, ctx.scaling, gq.transposed, gq.transposed_inv, xt, xt_inv)
        elif need_w_grad:  # [N, K] = g^T [N, M] @ x [M, K]: x^T [K, M] is the second operand
            grad_w = _mm(ctx.scaling, gq.transposed, gq.transposed_inv, xt, xt_inv, ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None


def fp8_shapes_ok(in_features: int, out_features: int, tokens: int | None = None, multiple: int = 16) -> bool:
    """Whether the FP8 GEMMs take the three GEMMs of this linear (every dimension a multiple of
    ``multiple``: ``gemm_multiple`` of the recipe)."""
    return all(n % multiple == 0 for n in (in_features, out_features, multiple if tokens is None else tokens))


def takes_main_grad(weight: torch.Tensor, fuse: bool) -> bool:
    """Whether a linear asked to ``fuse`` its weight gradient writes it into ``weight.main_grad``:
    the weight has one (not under FSDP2 or without an optimizer) and gets a gradient now."""
    return fuse and hasattr(weight, "main_grad") and weight.requires_grad and torch.is_grad_enabled()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: Fp8Scaling | None = None,
           into_main_grad: bool = False) -> torch.Tensor:  # fmt: skip
    """``F.linear``, in FP8 when ``fp8`` (the layer's scaling state) is given and the shapes allow it (else bf16);
    ``into_main_grad``: the FP8 weight gradient goes into ``weight.main_grad`` (the caller checked it has one)."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if fp8 is None or not fp8_shapes_ok(weight.shape[1], weight.shape[0], tokens, gemm_multiple(fp8.recipe.recipe)):
        return F.linear(x, weight, bias)
    update = torch.is_grad_enabled()  # evaluation forwards leave the amax histories alone
    y = _Fp8Linear.apply(x, weight, fp8, fp8.seeded, update, into_main_grad)
    if update:
        fp8.seeded = True
    return y if bias is None else y + bias


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in FP8; ``apply_fp8`` puts one in each linear's place (same
    parameters) and gives each its ``fp8`` scaling state (the parameters, their names and the state dict stay
    those of the ``nn.Linear``: the state's histories are not persistent). ``skip_bias_add``: the
    bias is left to the caller (``layers/mlp.enable_bias_gelu_fusion``); ``grad_accum_fusion``: set
    by ``grad_accum_fusion.apply_gradient_accumulation_fusion``."""

    fp8: Fp8Scaling
    skip_bias_add = False
    grad_accum_fusion = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        into_main_grad = takes_main_grad(self.weight, self.grad_accum_fusion)
        return linear(x, self.weight, None if self.skip_bias_add else self.bias, self.fp8, into_main_grad)


@functools.cache
def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def check_fp8_device(device: torch.device) -> None:
    """Fail before building anything where no FP8 GEMM exists (the CPU, NVIDIA before sm_89, AMD
    before MI300: ``platform.fp8_refusal``)."""
    refusal = platform.fp8_refusal(device)
    if refusal:
        raise ValueError(refusal)


def _torchao_fits(recipe: Fp8Recipe, tensor_parallel: bool) -> bool:
    return recipe.format == "hybrid" and recipe.recipe == "tensorwise" and not tensor_parallel


def resolve_backend(recipe: Fp8Recipe, backend: str, tensor_parallel: bool) -> str:
    """The backend ``--fp8-backend`` means for blocks with (``tensor_parallel``) or without
    tensor-parallel linears: ``auto`` is torchao where it applies (see ``apply_fp8``), else meshtron."""
    if backend != "auto":
        return backend
    ocp = platform_family() == "ocp"
    return "torchao" if torchao_available() and _torchao_fits(recipe, tensor_parallel) and ocp else "meshtron"


def apply_fp8(blocks: nn.Module, recipe: Fp8Recipe, backend: str = "auto") -> str:
    """Turn the linear layers under ``blocks`` (the transformer blocks: the embedding and output
    layer stay bf16, as in Transformer Engine recipes; ``--fp8-output-layer`` converts the latter
    on its own: ``fp8_output``) into FP8 layers, in place.

    ``backend``: ``torchao`` (its Float8Linear, tensorwise recipe: e4m3 forward, e5m2 gradients,
    so only ``hybrid`` and ``tensorwise``), ``meshtron`` (``Fp8Linear`` above; tensor-parallel
    linears get their ``fp8`` state and call the same function), or ``auto``: torchao where it
    applies (installed, hybrid tensorwise, no tensor-parallel layer, the OCP formats: not on
    gfx942, whose fnuz formats meshtron's path is tested with), else meshtron. Returns the
    backend used.
    """
    grad_dtype(recipe.format)  # validates the format
    parallel = [m for m in blocks.modules() if hasattr(m, "fp8") and not isinstance(m, nn.Linear)]
    backend = resolve_backend(recipe, backend, bool(parallel))
    if backend == "torchao":
        if not _torchao_fits(recipe, bool(parallel)):
            raise ValueError("the torchao FP8 backend takes --fp8-format hybrid --fp8-recipe tensorwise without tensor "
                             "parallelism; use --fp8-backend meshtron")  # fmt: skip
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(blocks, module_filter_fn=lambda m, _: fp8_shapes_ok(m.in_features, m.out_features))
        return backend
    def fp8_linear(linear: nn.Linear) -> Fp8Linear:
        new = with_parameters_of(Fp8Linear, linear)
        new.fp8 = Fp8Scaling(recipe, linear.weight.device)
        return new

    multiple = gemm_multiple(recipe.recipe)
    replace_linears(blocks, fp8_linear, keep=lambda m: fp8_shapes_ok(m.in_features, m.out_features, multiple=multiple))
    for module in parallel:
        module.fp8 = Fp8Scaling(recipe, module.weight.device)
    return backend
