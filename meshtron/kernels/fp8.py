"""FP8 linear layers for training: e4m3 forward, e5m2 ("hybrid") or e4m3 gradients, per-tensor
current scaling, on ``torch._scaled_mm``; or torchao's ``convert_to_float8_training`` when it is
installed.

Why FP8: an H100 runs e4m3 GEMMs at ~1.8x its bf16 rate (1369 vs 762 TFLOP/s, BENCHMARKS.md).
The weights stay bf16 with fp32 masters in the optimizer, exactly as without FP8; only the three
GEMMs of each linear (forward, grad of input, grad of weight) read FP8 copies made on the fly.

Scaling ("current", per tensor): each operand is multiplied by ``fmax / amax(|t|)`` before the
cast, so its largest value lands on the format's largest, and ``_scaled_mm`` multiplies the
product by the two inverse scales. e4m3 (3 mantissa bits, max 448) keeps precision for values;
gradients have a wider dynamic range, hence e5m2 (max 57344) in the hybrid format.

``_scaled_mm`` wants every GEMM dimension a multiple of 16 and its second operand column-major;
a layer whose features are not multiples of 16, or a call whose token count is not, runs the
plain bf16 ``F.linear`` instead. The saved activation is its FP8 copy (1 byte per element).

Tensor parallelism: the parallel linears of ``meshtron.parallel.tensor_parallel`` call
``linear`` below with their ``fp8_format``, so a sharded layer runs the same function on its shard.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_FORMATS = ("hybrid", "e4m3")
_GEMM_MULTIPLE = 16
_AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale


def grad_dtype(fp8_format: str) -> torch.dtype:
    """The FP8 type of output gradients: e5m2 for ``hybrid``, e4m3 for ``e4m3``."""
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8 format must be one of {FP8_FORMATS}, got '{fp8_format}'")
    return E5M2 if fp8_format == "hybrid" else E4M3


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` -> (FP8 tensor, fp32 inverse scale) with ``t ~= q.float() * inv_scale``.

    The scale maps ``amax(|t|)`` onto the format's largest value; the clamp only guards the
    rounding of ``t * scale`` a hair past it (e4m3fn has no infinity: it would become NaN).
    """
    fmax = torch.finfo(dtype).max
    amax = torch.linalg.vector_norm(t, ord=float("inf")).float().clamp(min=_AMAX_FLOOR)
    scale = fmax / amax
    q = (t * scale).clamp_(-fmax, fmax).to(dtype)  # a 0-d fp32 scale keeps t's dtype: no fp32 copy
    return q, scale.reciprocal()


def _mm(a: torch.Tensor, a_inv: torch.Tensor, b_t: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_inv) @ (b_t * b_inv)^T`` for row-major FP8 ``a`` [M, K] and ``b_t`` [N, K].

    ``_scaled_mm`` takes its second operand column-major: ``b_t.t()`` is exactly that view of a
    row-major [N, K] tensor, so the forward GEMM needs no copy; the backward GEMMs pass
    transposed copies made once.
    """
    return torch._scaled_mm(a, b_t.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


class _Fp8Linear(torch.autograd.Function):
    """y = x w^T with all three GEMMs in FP8 (bias added outside, in the input's dtype)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, g_dtype: torch.dtype) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq, x_inv = quantize(x2, E4M3)
        wq, w_inv = quantize(weight, E4M3)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.g_dtype, ctx.x_dtype, ctx.w_dtype = g_dtype, x.dtype, weight.dtype
        return _mm(xq, x_inv, wq, w_inv, x.dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gq, g_inv = quantize(g2, ctx.g_dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # [M, K] = g [M, N] @ w [N, K]
            grad_x = _mm(gq, g_inv, wq.t().contiguous(), w_inv, ctx.x_dtype).view(*grad.shape[:-1], wq.shape[1])
        if ctx.needs_input_grad[1]:  # [N, K] = g^T [N, M] @ x [M, K]
            grad_w = _mm(gq.t().contiguous(), g_inv, xq.t().contiguous(), x_inv, ctx.w_dtype)
        return grad_x, grad_w, None


def fp8_shapes_ok(in_features: int, out_features: int, tokens: int = _GEMM_MULTIPLE) -> bool:
    """Whether ``_scaled_mm`` takes the three GEMMs of this linear (every dimension a multiple of 16)."""
    return all(n % _GEMM_MULTIPLE == 0 for n in (in_features, out_features, tokens))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8_format: str = "") -> torch.Tensor:
    """``F.linear``, in FP8 when ``fp8_format`` is set and the shapes allow it (else bf16)."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not fp8_format or not fp8_shapes_ok(weight.shape[1], weight.shape[0], tokens):
        return F.linear(x, weight, bias)
    y = _Fp8Linear.apply(x, weight, grad_dtype(fp8_format))
    return y if bias is None else y + bias


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in FP8; ``apply_fp8`` turns linears into it in place (the
    parameters, their names and the state dict stay those of the ``nn.Linear``)."""

    fp8_format: str = "hybrid"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fp8_format)


@functools.cache
def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def check_fp8_device(device: torch.device) -> None:
    """Fail before building anything where no FP8 GEMM exists (the CPU, GPUs before sm_89)."""
    if device.type != "cuda":
        raise ValueError(
            f"--fp8-format needs a GPU with FP8 tensor cores (NVIDIA sm_89+ such as H100, or AMD MI300); "
            f"this run is on '{device.type}'. Drop --fp8-format to train in bf16/fp32."
        )
    if torch.version.hip is None and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"--fp8-format needs FP8 tensor cores (sm_89+); {name} has none. Drop --fp8-format.")


def apply_fp8(blocks: nn.Module, fp8_format: str, backend: str = "auto") -> str:
    """Turn the linear layers under ``blocks`` (the transformer blocks: the embedding and output
    layer stay bf16, as in Transformer Engine recipes) into FP8 layers, in place.

    ``backend``: ``torchao`` (its Float8Linear, tensorwise recipe: e4m3 forward, e5m2 gradients,
    so only ``hybrid``), ``meshtron`` (``Fp8Linear`` above; tensor-parallel linears get
    ``fp8_format`` and call the same function), or ``auto``: torchao when installed, the format is
    hybrid and no layer is tensor-parallel, else meshtron. Returns the backend used.
    """
    grad_dtype(fp8_format)  # validates the format
    plain = [m for m in blocks.modules() if type(m) is nn.Linear]
    parallel = [m for m in blocks.modules() if hasattr(m, "fp8_format") and not isinstance(m, nn.Linear)]
    if backend == "auto":
        backend = "torchao" if torchao_available() and fp8_format == "hybrid" and not parallel else "meshtron"
    if backend == "torchao":
        if fp8_format != "hybrid" or parallel:
            raise ValueError("the torchao FP8 backend takes --fp8-format hybrid without tensor parallelism; use --fp8-backend meshtron")
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(blocks, module_filter_fn=lambda m, _: fp8_shapes_ok(m.in_features, m.out_features))
        return backend
    for module in plain:
        if fp8_shapes_ok(module.in_features, module.out_features):
            module.__class__ = Fp8Linear
            module.fp8_format = fp8_format
    for module in parallel:
        module.fp8_format = fp8_format
    return backend
