"""The fused kernels context parallelism attends one block with: PyTorch's attention kernels that
return the log-sum-exp (flash, cuDNN), and which of them ``auto`` means on this platform.

They work on SDPA's [b, heads, s, d] views. Dropout is 0 (context parallelism refuses attention
dropout), so the random-number state the kernels return is a placeholder, handed back to their
backward as is.
"""

from __future__ import annotations

import torch

from meshtron.errors import ConfigError
from meshtron.kernels import platform


class FlashKernel:
    """PyTorch's flash-attention 2 (``aten._scaled_dot_product_flash_attention`` and its backward).
    Grouped heads are native: the kernel reads each kv head for its group and sums its gradient."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, (cum_q, cum_k, seed, offset)

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, causal: bool, scale: float):
        cum_q, cum_k, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale
        )


class CudnnKernel:
    """cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention``). The raw op is not
    documented to take grouped heads, so k/v are repeated to the query heads and their gradients
    summed over each group; its log-sum-exp comes as [b, heads, s, 1] in some releases."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.flatten(2), (cum_q, cum_k, seed, offset, lse.dim())

    @staticmethod
    def backward(dout, q, k, v, out, lse, aux, causal: bool, scale: float):
        cum_q, cum_k, seed, offset, lse_dims = aux
        kv_heads, group = k.shape[1], q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        lse = lse if lse_dims == 3 else lse.unsqueeze(-1)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse, seed, offset, None, cum_q, cum_k, q.shape[2], k.shape[2],
            0.0, causal, scale=scale,
        )  # fmt: skip
        return dq, dk.unflatten(1, (kv_heads, group)).sum(2), dv.unflatten(1, (kv_heads, group)).sum(2)


class PaddedValues:
    """A block kernel that takes values only as wide as q/k (flash) run on narrower ones (MLA's
    192 / 128): v, and in backward the output and its gradient, zero-padded to the q/k width
    (zero columns of v add zero output columns and change no score), the extra columns dropped."""

    def __init__(self, kernel):
        self.kernel = kernel

    @staticmethod
    def _pad(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, q.shape[-1] - t.shape[-1]))

    def forward(self, q, k, v, causal: bool, scale: float):
        out, lse, aux = self.kernel.forward(q, k, self._pad(v, q), causal, scale)
        return out[..., : v.shape[-1]], lse, aux

    def backward(self, dout, q, k, v, out, lse, aux, causal: bool, scale: float):
        pad = self._pad
        dq, dk, dv = self.kernel.backward(pad(dout, q), q, k, pad(v, q), pad(out, q), lse, aux, causal, scale)
        return dq, dk, dv[..., : v.shape[-1]]


BLOCK_KERNELS = {"flash": FlashKernel, "cudnn": CudnnKernel}
KERNEL_CHOICES = ("auto", "math", *BLOCK_KERNELS)


def auto_block_kernel() -> str:
    """``auto``'s kernel: cuDNN where PyTorch has it (1.56-1.91x flash per block on an H200: bf16,
    32 heads, 8 kv heads, d 128, 4K and 16K blocks; RESULTS.md), else flash (ROCm, whose cuDNN op
    always raises)."""
    return "cudnn" if platform.cudnn_attention() else "flash"


def block_kernel(choice, q: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None):
    """The fused kernel for these inputs, or None for the fp32 math path: a kernel runs on CUDA
    in bf16/fp16 without packed documents. ``choice`` is a name of ``KERNEL_CHOICES`` or a kernel
    object (tests pass a CPU stand-in with the kernels' conventions). Flash takes values narrower
    than q/k (MLA's 192 / 128) zero-padded (``PaddedValues``), cuDNN as they are."""
    if choice == "math" or document_ids is not None:
        return None
    if not isinstance(choice, str):
        return choice
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"unknown context-parallel block kernel '{choice}': use one of {KERNEL_CHOICES}")
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    kernel = auto_block_kernel() if choice == "auto" else choice
    if kernel == "flash" and v.shape[-1] != q.shape[-1]:
        if v.shape[-1] > q.shape[-1]:
            raise ConfigError(f"the flash block kernel takes value heads at most as wide as q/k heads, got {v.shape[-1]} "
                              f"and {q.shape[-1]}; use --attention-backend cudnn or math")  # fmt: skip
        return PaddedValues(FlashKernel)
    return BLOCK_KERNELS[kernel]
