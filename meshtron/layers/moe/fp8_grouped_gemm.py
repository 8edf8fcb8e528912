"""FP8 experts: the routed experts' grouped GEMMs in e4m3 with rowwise scales (``model.moe_fp8
rowwise``, on whenever ``--fp8-format`` is set), as torchao's ``_Float8GroupedMM`` (torchtitan's
Float8 grouped experts) scales them.

Forward ``out = x W_g^T``: x scaled per row (per token, over the hidden features), each expert's
weight per output row (per (expert, output channel), over the input features). Input gradient
``dx = dout W_g``: dout per row, the weight transposed per (expert, input channel), over the output
features. Every scale is a power of two (the largest whose product fits e4m3), so scaling is exact
and only the FP8 rounding errs. All operands are e4m3 whatever ``--fp8-format`` says:
``torch._scaled_grouped_mm`` takes e4m3 only (as meshtron's rowwise linears). Forward uses fast
accumulation, the input gradient the exact one (Transformer Engine's choice for each GEMM).

The weight gradient stays bf16 (fp32 accumulation): with gradient-accumulation fusion (on by
default) the Triton kernel writes it straight into the fp32 ``main_grad``; FP8 there would need
both operands scaled per expert along the tokens (two more casts of the largest activations, expert
groups padded to 16 rows) and its bf16 output added into ``main_grad`` by another pass.

GEMM backends (``--model.moe_grouped_gemm`` picks: ``auto``, ``torch`` = ``scaled``, ``loop``):

- ``scaled``: ``torch._scaled_grouped_mm(a [M, K] row-major, b [E, K, N] column-major, scale_a [M],
  scale_b [E, N], offs=int32 group ends, out_dtype=bf16, use_fast_accum)`` — the signature of
  torch 2.8 through 2.13; CUDA only (sm90, MI300+); probed once per device with a small GEMM
  checked against the reference.
- ``loop``: one ``torch._scaled_mm`` per expert with row / column scales (a host sync for the
  group sizes); any device where ``_scaled_mm`` runs rowwise, the CPU included.
- ``reference``: both operands dequantized to fp32, one matmul per expert: the CPU's path, and what
  the tests hold the others to.
"""

from __future__ import annotations

import functools

import torch

from meshtron.config import ModelConfig
from meshtron.kernels import step_cache, use_triton
from meshtron.kernels.fp8_blockwise import pow2_scale
from meshtron.kernels.fp8_cast import Quantized, cast_reference
from meshtron.kernels.fp8_scaling import FP8_FAMILIES, platform_family
from meshtron.layers.moe.grouped_gemm import fuses_weight_grad, grouped_weight_grad, resolve_backend, weight_grad_into_main_grad

FP8_EXPERT_MODES = ("rowwise", "off")
FP8_GEMM_BACKENDS = ("auto", "scaled", "loop", "reference")
# --model.moe_grouped_gemm -> the FP8 GEMM backend (triton has no FP8 kernel: refused by validation).
FOR_GROUPED_GEMM = {"auto": "auto", "torch": "scaled", "loop": "loop"}


def fp8_experts(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s routed experts run FP8 grouped GEMMs (``--fp8-format`` set, ``model.moe_fp8 rowwise``)."""
    return bool(cfg.fp8_format) and cfg.moe_fp8 == "rowwise"


def fp8_grouped_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 operands, both GEMM widths multiples of 16 (``_scaled_grouped_mm``'s rule) and some rows
    (an expert-parallel rank may receive none); else the bf16 GEMM runs."""
    widths_ok = weight.shape[1] % 16 == 0 and weight.shape[2] % 16 == 0
    return widths_ok and x.dtype == weight.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] > 0


def e4m3(device: torch.device) -> torch.dtype:
    return FP8_FAMILIES[platform_family(device)][0]


def quantize_rows(t: torch.Tensor, dtype: torch.dtype, fused_kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [M, K] -> (FP8 copy, inverse scales [M] fp32), one power-of-two scale per row."""
    if use_triton(fused_kernels, t):
        from meshtron.kernels.triton_fp8_grouped import cast_rows

        return cast_rows(t.contiguous(), dtype)
    scale = pow2_scale(torch.linalg.vector_norm(t, float("inf"), dim=1), torch.finfo(dtype).max)
    return cast_reference(t, scale[:, None], dtype, True, False, False).rows, scale.reciprocal()


def quantize_weights(w: torch.Tensor, dtype: torch.dtype, rows: bool, transposed: bool, fused_kernels: str = "auto") -> Quantized:
    """Stacked weights [E, N, K] -> rows copy [E, N, K] with inverse scales [E, N] (over k) and
    transposed copy [E, K, N] with inverse scales [E, K] (over n), those asked for."""
    fmax = torch.finfo(dtype).max
    if use_triton(fused_kernels, w):
        from meshtron.kernels.triton_fp8_grouped import cast_weights, weight_amaxes

        w = w.contiguous()
        row_amax, col_amax = weight_amaxes(w)
        row_scale, col_scale = pow2_scale(row_amax, fmax), pow2_scale(col_amax, fmax)
        q, qt = cast_weights(w, row_scale, col_scale, dtype, rows, transposed)
    else:
        row_scale = pow2_scale(torch.linalg.vector_norm(w, float("inf"), dim=2), fmax)
        col_scale = pow2_scale(torch.linalg.vector_norm(w, float("inf"), dim=1), fmax)
        q = cast_reference(w, row_scale[:, :, None], dtype, True, False, False).rows if rows else None
        qt = cast_reference(w, col_scale[:, None, :], dtype, True, False, False).rows.transpose(1, 2).contiguous() if transposed else None
    return Quantized(q, row_scale.reciprocal() if rows else None, qt, col_scale.reciprocal() if transposed else None)


def scaled_grouped_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, group_sizes: torch.Tensor,
                      backend: str, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:  # fmt: skip
    """FP8 ``a`` [M, K] (inverse row scales ``a_inv`` [M]) grouped by ``group_sizes`` [E], times
    expert g's FP8 ``b[g]`` [N, K] (nn.Linear layout; inverse row scales ``b_inv`` [E, N]) transposed -> [M, N]."""
    if backend == "scaled":
        offsets = torch.cumsum(group_sizes, 0, dtype=torch.int32)
        return torch._scaled_grouped_mm(a, b.transpose(1, 2), a_inv, b_inv, offs=offsets, out_dtype=out_dtype,
                                        use_fast_accum=fast_accum)  # fmt: skip
    sizes = group_sizes.tolist()
    parts, unit = [], torch.ones((), device=a.device) if backend == "loop" else None
    for g, (rows, rows_inv) in enumerate(zip(torch.split(a, sizes), torch.split(a_inv, sizes))):
        if not sizes[g]:
            continue
        if backend == "loop":
            # Tensorwise _scaled_mm (unit scales, fp32 out) runs on every FP8 GPU, where rowwise scaling
            # is refused by some cuBLASLt builds; the power-of-two row scales applied after it give
            # the same product. cuBLASLt's FP8 GEMM wants the rows in multiples of 16: zero rows pad.
            pad = -sizes[g] % 16
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows
            product = torch._scaled_mm(rows, b[g].t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32,
                                       use_fast_accum=fast_accum)[: sizes[g]]  # fmt: skip
            parts.append((product * rows_inv[:, None] * b_inv[g][None, :]).to(out_dtype))
        else:
            parts.append(((rows.float() * rows_inv[:, None]) @ (b[g].float() * b_inv[g][:, None]).t()).to(out_dtype))
    return torch.cat(parts) if parts else a.new_zeros(0, b.shape[1], dtype=out_dtype)


@functools.cache
def scaled_grouped_mm_runs(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` and agrees with the reference on a
    small GEMM with ragged and empty groups (deterministic inputs: it runs inside the first forward;
    small integers times powers of two, so any accumulation order gives the same bf16 result)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    try:
        with torch.inference_mode(False), torch.no_grad():
            dtype = e4m3(device)
            a = (torch.arange(48 * 32, device=device) % 7 - 3).view(48, 32).float().to(dtype)
            b = (torch.arange(3 * 32 * 32, device=device) % 5 - 2).view(3, 32, 32).float().to(dtype)
            a_inv, b_inv = torch.full((48,), 0.5, device=device), torch.full((3, 32), 0.25, device=device)
            sizes = torch.tensor([5, 0, 43], device=device)  # groups not multiples of 16, as a router leaves them
            got = scaled_grouped_mm(a, a_inv, b, b_inv, sizes, "scaled", torch.bfloat16)
            want = scaled_grouped_mm(a, a_inv, b, b_inv, sizes, "reference", torch.bfloat16)
        return bool(torch.equal(got, want))
    except (RuntimeError, NotImplementedError):
        return False


def resolve_fp8_backend(x: torch.Tensor, grouped_gemm: str) -> str:
    """The FP8 GEMM backend for ``--model.moe_grouped_gemm`` (or an FP8 backend named directly)."""
    backend = FOR_GROUPED_GEMM.get(grouped_gemm, grouped_gemm)
    if backend not in FP8_GEMM_BACKENDS:
        raise ValueError(f"FP8 experts run on --model.moe_grouped_gemm auto, torch or loop (no Triton FP8 grouped GEMM), "
                         f"got '{grouped_gemm}'; change it or set model.moe_fp8 off")  # fmt: skip
    if backend == "auto":
        return "scaled" if scaled_grouped_mm_runs(x.device) else ("loop" if x.is_cuda else "reference")
    if backend == "scaled" and not scaled_grouped_mm_runs(x.device):
        raise RuntimeError(f"--model.moe_grouped_gemm torch with FP8 experts: torch._scaled_grouped_mm does not run on "
                           f"{x.device} (it needs CUDA sm90 or MI300+); use auto or loop, or set model.moe_fp8 off")  # fmt: skip
    return backend


def _weight_copies(weight: torch.Tensor, dtype: torch.dtype, transposed: bool, fused_kernels: str) -> Quantized:
    """The weight's FP8 copies: both, once per step, where ``step_cache`` keeps them (a step of
    several micro batches), else those this call needs."""
    if step_cache.keeps(weight):
        return step_cache.derived(weight, f"fp8 experts {dtype}", lambda: quantize_weights(weight, dtype, True, True, fused_kernels))
    return quantize_weights(weight, dtype, True, transposed, fused_kernels)


class _Fp8GroupedMM(torch.autograd.Function):
    """x [R, K] grouped times weight [E, N, K]: forward and input gradient in FP8, weight gradient
    in bf16 (into ``main_grad`` when ``fuse``). Saves x (the weight gradient's operand, as bf16's
    path does) and the weight's transposed FP8 copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, backend: str, wgrad_backend: str,
                fused_kernels: str, fuse: bool) -> torch.Tensor:  # fmt: skip
        dtype = e4m3(x.device)
        xq, x_inv = quantize_rows(x, dtype, fused_kernels)
        wq = _weight_copies(weight, dtype, ctx.needs_input_grad[0], fused_kernels)
        ctx.save_for_backward(x, wq.transposed, wq.transposed_inv, group_sizes)
        ctx.param, ctx.experts, ctx.dtype = weight, weight.shape[0], dtype  # the parameter, with its main_grad
        ctx.backend, ctx.wgrad_backend, ctx.fused_kernels, ctx.fuse = backend, wgrad_backend, fused_kernels, fuse
        return scaled_grouped_mm(xq, x_inv, wq.rows, wq.rows_inv, group_sizes, backend, x.dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, wt, wt_inv, group_sizes = ctx.saved_tensors
        grad_out = grad_out.contiguous()  # an expanded (stride-0) gradient, e.g. of out.sum()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq, g_inv = quantize_rows(grad_out, ctx.dtype, ctx.fused_kernels)
            grad_x = scaled_grouped_mm(gq, g_inv, wt, wt_inv, group_sizes, ctx.backend, grad_out.dtype)
        if ctx.fuse:
            weight_grad_into_main_grad(ctx.param, grad_out, x, group_sizes)
        elif ctx.needs_input_grad[1]:
            grad_w = grouped_weight_grad(grad_out, x, group_sizes, ctx.experts, ctx.wgrad_backend)
        return grad_x, grad_w, None, None, None, None, None


@torch.compiler.disable  # as the bf16 grouped GEMM's Triton paths: run eagerly inside a compiled block
def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, grouped_gemm: str = "auto",
                   fused_kernels: str = "auto", fuse_wgrad: bool = False) -> torch.Tensor:  # fmt: skip
    """As ``grouped_mm`` (x [R, K] grouped by ``group_sizes`` [E] times weight [E, N, K] -> [R, N]),
    the forward and input gradient in FP8 (``fp8_grouped_usable`` must hold). ``grouped_gemm``: the
    ``--model.moe_grouped_gemm`` setting, or an FP8 backend by name; the weight gradient runs on
    that setting's bf16 backend (``fuse_wgrad``: into ``weight.main_grad``)."""
    backend = resolve_fp8_backend(x, grouped_gemm)
    wgrad_backend = resolve_backend(x, weight, {"scaled": "torch", "reference": "auto"}.get(grouped_gemm, grouped_gemm))
    fuse = fuses_weight_grad(x, weight, wgrad_backend, fuse_wgrad)
    return _Fp8GroupedMM.apply(x, weight, group_sizes, backend, wgrad_backend, fused_kernels, fuse)
