"""Rotary embedding applied to q or k: the fp32 reference and a one-pass kernel.

Unfused, the rotation upcasts x to fp32, builds the rotated-half copy and two products (several
full-size fp32 temporaries per call, twice per layer). The kernel reads the (possibly strided)
slice of the QKV projection once and writes the rotated heads once; its backward is the same
kernel rotating by the opposite angle, so nothing but the tables is kept.
"""

from __future__ import annotations

import torch

from meshtron.kernels import use_triton


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _table_rows(table: torch.Tensor, seq_len: int, position_ids: torch.Tensor | None) -> torch.Tensor:
    if position_ids is None:
        return table[:seq_len].unsqueeze(1)  # [s, 1, d]
    return table[position_ids].unsqueeze(2)  # [b, s, 1, d]


def apply_rotary_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    x32 = x.float()
    cos, sin = _table_rows(cos, x.shape[1], position_ids), _table_rows(sin, x.shape[1], position_ids)
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, position_ids):
        from meshtron.kernels.triton_pointwise import rope

        ctx.save_for_backward(cos, sin, position_ids)
        return rope(x, cos, sin, position_ids, sign=1)

    @staticmethod
    def backward(ctx, grad):
        from meshtron.kernels.triton_pointwise import rope

        cos, sin, position_ids = ctx.saved_tensors
        return rope(grad, cos, sin, position_ids, sign=-1), None, None, None


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None = None,
    fused_kernels: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """Rotate ``x`` [b, s, heads, head_dim] by its positions (rows of the fp32 [positions, d] tables).

    ``position_ids`` [b, s] picks rows of the tables (packed documents restart at 0, a KV-cache
    chunk starts at the cache length); without it, token ``t`` sits at position ``t``.
    """
    if use_triton(fused_kernels, x):
        return _Rotary.apply(x, cos.contiguous(), sin.contiguous(), position_ids)
    return apply_rotary_reference(x, cos, sin, position_ids)
