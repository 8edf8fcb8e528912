"""Grouped GEMM: row group g of ``x`` times expert g's weight, for variable-size (even empty) groups.

Backends (``--model.moe_grouped_gemm``; Megatron's ``--moe-grouped-gemm`` switch means ``auto``):

- ``loop``: one matmul per expert, the reference; E kernel launches and a host sync for the
  group sizes, slow on a GPU with many small experts.
- ``torch``: ``torch._grouped_mm``, one call for all experts, with autograd.
- ``triton``: our Triton kernels (``meshtron/kernels/triton_grouped_gemm.py``), forward and
  backward, any width and dtype alignment, no host sync (on Hopper a persistent TMA kernel for the
  forward and input gradient); on a CPU only under Triton's interpreter.
- ``auto``: ``torch`` where it works for these tensors and is one kernel, else ``triton`` on a
  GPU with Triton installed (a build without ``_grouped_mm``; ROCm where ``_grouped_mm`` is a
  host-synced loop over the groups: gfx90a, or a build without CK), else ``torch`` or ``loop``.

With gradient-accumulation fusion (``--gradient-accumulation-fusion``, ``fuse_wgrad``) the weight
gradient skips the bf16 tensor and the buffer's add: the Triton weight-gradient kernel writes (or
adds) it in fp32 into ``weight.main_grad`` while the forward and input gradient still run on the
chosen backend. The experts hold most of a MoE model's parameters, so this is most of the
gradient traffic.

``torch._grouped_mm`` is private and its support differs by build, device and dtype, so it is
probed once per (device, dtype) with a tiny forward and backward rather than trusted from the
version. In torch 2.13's CPU build it exists and runs fp32, bf16 and fp16 (forward and
backward) but refuses tensors whose row strides are not a multiple of 16 bytes (so h and the
expert width must be multiples of 4 in fp32, 8 in bf16), offsets that are not int32, an output
dtype other than the input's, and a stride-0 (expanded) output gradient in backward, e.g. that
of ``out.sum()``; inside the MoE layer the gradient always arrives materialized. torch 2.11 on
an H100 ran the same three dtypes under the same alignment rule, at 2.5x the loop's speed
(bf16, 64 experts of DeepSeek-V2-Lite's fc1 shape, 49k rows).
"""

from __future__ import annotations

import functools

import torch

from meshtron.kernels import deferred_wgrad, interpreted, platform, triton_available

GROUPED_GEMM_BACKENDS = ("auto", "loop", "torch", "triton")


def grouped_mm_loop(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """x [R, K], weight [E, N, K] (nn.Linear layout per expert), group_sizes [E] -> [R, N]."""
    groups = torch.split(x, group_sizes.tolist())
    return torch.cat([group @ weight[e].t() for e, group in enumerate(groups)])


def grouped_mm_torch(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """As ``grouped_mm_loop``, in one ``torch._grouped_mm`` call (offsets: int32 group ends)."""
    offsets = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@functools.cache
def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here, with one empty group.

    Probed outside inference mode and with grad on whatever the first caller runs under, so a
    first call from generation does not record a false "no". The probe's tensors are not random:
    it runs inside the first forward, and drawing from the global generator there would shift
    every later dropout mask and jitter (a resumed run would then differ from the straight one).
    For the same reason its saved tensors bypass any activation checkpoint around that forward.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # Identity hooks: an enclosing activation checkpoint must not count the probe's saved
        # tensors, or its recompute (which finds the answer cached) saves fewer than the forward.
        with torch.inference_mode(False), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            x = torch.ones(8, 16, device=device, dtype=dtype, requires_grad=True)
            weight = torch.ones(3, 16, 16, device=device, dtype=dtype, requires_grad=True)
            out = grouped_mm_torch(x, weight, torch.tensor([3, 0, 5], device=device))
            out.backward(torch.ones_like(out))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def torch_grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs on this device and dtype and these shapes meet its alignment."""
    row_bytes = [size * x.element_size() for size in (weight.shape[1], weight.shape[2])]
    aligned = all(b % 16 == 0 for b in row_bytes) and x.is_contiguous() and x.data_ptr() % 16 == 0
    return aligned and x.dtype == weight.dtype and _grouped_mm_runs(x.device, x.dtype)


@functools.cache
def _grouped_mm_syncs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` waits for the host here: ROCm's fallback (no CK in the build)
    copies the offsets to the host and loops over the groups. Probed with PyTorch's sync debug
    mode raising on a synchronizing call; deterministic inputs, as ``_grouped_mm_runs``."""
    previous = torch.cuda.get_sync_debug_mode()
    try:
        with torch.inference_mode(False), torch.no_grad():
            x, weight = torch.ones(8, 16, device=device, dtype=dtype), torch.ones(3, 16, 16, device=device, dtype=dtype)
            sizes = torch.tensor([3, 0, 5], device=device)
            torch.cuda.set_sync_debug_mode("error")
            grouped_mm_torch(x, weight, sizes)
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def torch_grouped_mm_is_one_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` (where it runs) is one kernel rather than a loop: on NVIDIA
    yes; on ROCm only on gfx942/gfx950 (``platform``) in a build whose call does not sync."""
    if device.type != "cuda":
        return True
    if not platform.grouped_mm_may_be_fast(device):
        return False
    return not (platform.is_rocm() and _grouped_mm_syncs(device, dtype))


def auto_backend(device: torch.device, dtype: torch.dtype, torch_usable: bool, triton_usable: bool) -> str:
    """What ``auto`` means given which backends can take the tensors (see the module docstring)."""
    if torch_usable and torch_grouped_mm_is_one_kernel(device, dtype):
        return "torch"
    if triton_usable:
        return "triton"
    return "torch" if torch_usable else "loop"


def triton_grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Triton is installed and can run on ``x``'s device (a GPU, or the CPU under its interpreter),
    and ``x`` and ``weight`` share a dtype (no mixed-dtype tile products)."""
    on_device = x.is_cuda or interpreted()
    return triton_available() and on_device and x.dtype == weight.dtype


def resolve_backend(x: torch.Tensor, weight: torch.Tensor, backend: str) -> str:
    """The backend ``backend`` means for these tensors, or a clear error where it cannot run."""
    if backend not in GROUPED_GEMM_BACKENDS:
        raise ValueError(f"--model.moe_grouped_gemm must be one of {', '.join(GROUPED_GEMM_BACKENDS)}, got '{backend}'")
    if backend == "auto":
        return auto_backend(x.device, x.dtype, torch_grouped_mm_usable(x, weight), x.is_cuda and triton_grouped_mm_usable(x, weight))
    if backend == "torch" and not torch_grouped_mm_usable(x, weight):
        raise RuntimeError(
            f"--model.moe_grouped_gemm torch: torch._grouped_mm does not run here ({x.device.type}, {x.dtype}, "
            f"widths {weight.shape[2]} -> {weight.shape[1]}; rows must be multiples of 16 bytes); use auto, triton or loop"
        )
    if backend == "triton" and not triton_grouped_mm_usable(x, weight):
        raise RuntimeError(
            f"--model.moe_grouped_gemm triton needs Triton installed, a GPU (on {x.device.type}: only under "
            f"TRITON_INTERPRET=1) and one dtype for input and weight ({x.dtype}, {weight.dtype}); use auto or loop"
        )
    return backend


def _group_bounds(group_sizes: torch.Tensor, backend: str) -> torch.Tensor:
    """The groups as ``backend``'s kernels read them: ``torch._grouped_mm``'s int32 group ends [E],
    or the Triton kernels' offsets [E + 1] (``group_offsets``)."""
    if backend == "torch":
        return torch.cumsum(group_sizes, 0, dtype=torch.int32)
    from meshtron.kernels.triton_grouped_gemm import group_offsets

    return group_offsets(group_sizes)


def _rows_times(x: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, backend: str) -> torch.Tensor:
    """x [R, K] grouped (``bounds``: ``_group_bounds``'), times b [E, K, N] per group (any strides)
    -> [R, N], on ``torch`` or ``triton``."""
    if backend == "torch":
        return torch._grouped_mm(x, b, offs=bounds)
    from meshtron.kernels.triton_grouped_gemm import rows_times_group

    return rows_times_group(x, b, bounds)


class _GroupedMMIntoMainGrad(torch.autograd.Function):
    """``grouped_mm`` whose weight gradient goes into ``weight.main_grad`` (written if it is the
    step's first, else added) and is reported to the gradient buffer; autograd gets none. The
    groups' bounds are computed once, for the forward and the input gradient (and, on the Triton
    backend, the weight gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, backend: str) -> torch.Tensor:
        bounds = _group_bounds(group_sizes, backend)
        ctx.save_for_backward(x, weight, group_sizes, bounds)
        ctx.backend, ctx.param = backend, weight  # the parameter, with its main_grad (see grad_accum_fusion)
        return _rows_times(x, weight.transpose(1, 2), bounds, backend)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, group_sizes, bounds = ctx.saved_tensors
        grad_out = grad_out.contiguous()  # an expanded (stride-0) gradient, e.g. of out.sum()
        grad_x = _rows_times(grad_out, weight, bounds, ctx.backend) if ctx.needs_input_grad[0] else None
        weight_grad_into_main_grad(ctx.param, grad_out, x, group_sizes, bounds if ctx.backend == "triton" else None)
        return grad_x, None, None, None


def weight_grad_into_main_grad(param: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor,
                               offsets: torch.Tensor | None = None) -> None:  # fmt: skip
    """The experts' weight gradient ``grad_out_g^T @ x_g`` by the Triton kernel into ``param.main_grad``
    in fp32 (written if it is the step's first, else added), now or in a zero-bubble schedule's W.
    ``offsets``: the groups' ``group_offsets`` where the caller has them."""
    from meshtron.kernels.triton_grouped_gemm import group_offsets, group_weight_grad

    offsets = group_offsets(group_sizes) if offsets is None else offsets

    def wgrad(overwrite: bool) -> None:
        group_weight_grad(grad_out, x, offsets, param.shape[0], out=param.main_grad, accumulate=not overwrite)

    deferred_wgrad.defer_or_run(param, wgrad)


def grouped_weight_grad(grad_out: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor, experts: int, backend: str) -> torch.Tensor:
    """grad_out [R, N] and x [R, K] grouped by ``group_sizes`` -> [E, N, K], expert g's
    ``grad_out_g^T @ x_g`` (zeros for an empty group), on ``backend`` (``resolve_backend``'s)."""
    if backend == "triton":
        from meshtron.kernels.triton_grouped_gemm import group_offsets, group_weight_grad

        return group_weight_grad(grad_out, x, group_offsets(group_sizes), experts)
    if backend == "torch":
        return torch._grouped_mm(grad_out.t(), x, offs=torch.cumsum(group_sizes, 0, dtype=torch.int32))
    sizes = group_sizes.tolist()
    return torch.stack([g.t() @ rows for g, rows in zip(torch.split(grad_out, sizes), torch.split(x, sizes))])


def fuses_weight_grad(x: torch.Tensor, weight: torch.Tensor, backend: str, fuse_wgrad: bool) -> bool:
    """Whether the weight gradient goes into ``weight.main_grad`` by the Triton kernel: asked for,
    the weight has one and gets a gradient now, the backend is not the loop, and Triton runs here."""
    wanted = fuse_wgrad and backend != "loop" and hasattr(weight, "main_grad") and weight.requires_grad
    return wanted and torch.is_grad_enabled() and triton_grouped_mm_usable(x, weight)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, backend: str = "auto",
               fuse_wgrad: bool = False) -> torch.Tensor:  # fmt: skip
    """x [R, K] grouped by ``group_sizes`` [E] (summing to R) times weight [E, N, K] -> [R, N];
    ``fuse_wgrad``: the weight gradient into ``weight.main_grad`` where it has one (see module doc)."""
    backend = resolve_backend(x, weight, backend)
    if fuses_weight_grad(x, weight, backend, fuse_wgrad):
        return _fused_grouped_mm(x, weight, group_sizes, backend)
    if backend == "triton":
        from meshtron.kernels.triton_grouped_gemm import grouped_mm_triton  # Triton stays optional

        return grouped_mm_triton(x, weight, group_sizes)
    return grouped_mm_torch(x, weight, group_sizes) if backend == "torch" else grouped_mm_loop(x, weight, group_sizes)


@torch.compiler.disable  # as grouped_mm_triton: run eagerly inside a compiled block
def _fused_grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, backend: str) -> torch.Tensor:
    return _GroupedMMIntoMainGrad.apply(x, weight, group_sizes, backend)
