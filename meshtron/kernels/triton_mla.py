"""Multi-head latent attention's queries and keys in one pass each way, for Triton.

What it replaces (``layers/mla.py``'s reference path, ~0.55 ms a DeepSeek-V2-Lite layer at 8192
tokens on an H100): the query's rope half reordered from adjacent pairs and rotated, then glued to
its no-rope half (``torch.cat``); the shared rope key rotated, broadcast to every head and glued
to each head's no-rope key; and in backward two more concatenations, the gradients of the split
query and key/value projections. Each of those copies a [tokens, heads, 192]-sized tensor at a
fraction of the memory bandwidth. Here one program takes one token, all heads:

- forward: q [b, s, H, nope + rope] -> q rotated; kv [b, s, H, nope + v] and the shared key
  k_rope [b, s, rope] -> k [b, s, H, nope + rope]; v is returned as the view of kv it is;
- backward: dq -> d(q) (rope half rotated back and re-interleaved), dk and dv -> d(kv) in one
  write, dk's rope half summed over heads in fp32 and rotated back -> d(k_rope).

Rotation follows ``kernels/rope.py`` (rotate-half on the reordered dims, fp32 arithmetic, one
rounding); the reordering is ``layers.rope.deinterleave`` (the HF checkpoints' adjacent pairs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshtron.kernels.triton_pointwise import token_position


@triton.jit
def _token(pos_ptr, cos_ptr, sin_ptr, seq_len, heads, table_stride, NOPE: tl.constexpr, HALF: tl.constexpr,
           HAS_POS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """This program's token (index, batch row, position in it), the head and column indices with
    their masks, and the token's cos/sin."""
    pid, b, s, pos = token_position(pos_ptr, seq_len, HAS_POS)
    h = tl.arange(0, BLOCK_H)[:, None]
    n = tl.arange(0, BLOCK_NOPE)[None, :]
    i = tl.arange(0, BLOCK_HALF)
    h_ok, i_ok = h < heads, i < HALF
    cos = tl.load(cos_ptr + pos * table_stride + i, mask=i_ok, other=0.0)
    sin = tl.load(sin_ptr + pos * table_stride + i, mask=i_ok, other=0.0)
    return pid, b, s, h, n, i, h_ok, i_ok, h_ok & (n < NOPE), h_ok & i_ok[None, :], cos, sin


@triton.jit
def _mla_forward_kernel(
    q_ptr, kv_ptr, kr_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_out_ptr,
    seq_len, heads, sqb, sqs, sqh, skvb, skvs, skvh, skrb, skrs, table_stride,
    NOPE: tl.constexpr, HALF: tl.constexpr, HAS_POS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    pid, b, s, h, n, i, h_ok, i_ok, nope_ok, half_ok, cos, sin = _token(
        pos_ptr, cos_ptr, sin_ptr, seq_len, heads, table_stride, NOPE, HALF, HAS_POS, BLOCK_H, BLOCK_NOPE, BLOCK_HALF)
    dtype = q_out_ptr.dtype.element_ty
    out = pid * heads * (NOPE + 2 * HALF) + h * (NOPE + 2 * HALF)  # both outputs [b, s, H, nope + rope], contiguous
    # The query: no-rope half copied, rope half (adjacent pairs) rotated.
    q = q_ptr + b * sqb + s * sqs + h * sqh
    tl.store(q_out_ptr + out + n, tl.load(q + n, mask=nope_ok), mask=nope_ok)
    x1 = tl.load(q + NOPE + 2 * i[None, :], mask=half_ok, other=0.0).to(tl.float32)
    x2 = tl.load(q + NOPE + 2 * i[None, :] + 1, mask=half_ok, other=0.0).to(tl.float32)
    tl.store(q_out_ptr + out + NOPE + i[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=half_ok)
    tl.store(q_out_ptr + out + NOPE + HALF + i[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=half_ok)
    # The key: each head's no-rope part from kv, the shared rope key rotated once and broadcast.
    kv = kv_ptr + b * skvb + s * skvs + h * skvh
    tl.store(k_out_ptr + out + n, tl.load(kv + n, mask=nope_ok), mask=nope_ok)
    kr = kr_ptr + b * skrb + s * skrs
    y1 = tl.load(kr + 2 * i, mask=i_ok, other=0.0).to(tl.float32)
    y2 = tl.load(kr + 2 * i + 1, mask=i_ok, other=0.0).to(tl.float32)
    r1 = tl.zeros((BLOCK_H, BLOCK_HALF), dtype=tl.float32) + (y1 * cos - y2 * sin)[None, :]
    r2 = tl.zeros((BLOCK_H, BLOCK_HALF), dtype=tl.float32) + (y2 * cos + y1 * sin)[None, :]
    tl.store(k_out_ptr + out + NOPE + i[None, :], r1.to(dtype), mask=half_ok)
    tl.store(k_out_ptr + out + NOPE + HALF + i[None, :], r2.to(dtype), mask=half_ok)


@triton.jit
def _mla_backward_kernel(
    dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, pos_ptr, grad_q_ptr, grad_kv_ptr, grad_kr_ptr,
    seq_len, heads, sdqb, sdqs, sdqh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, table_stride,
    NOPE: tl.constexpr, HALF: tl.constexpr, VDIM: tl.constexpr, HAS_POS: tl.constexpr, HAS_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    pid, b, s, h, n, i, h_ok, i_ok, nope_ok, half_ok, cos, sin = _token(
        pos_ptr, cos_ptr, sin_ptr, seq_len, heads, table_stride, NOPE, HALF, HAS_POS, BLOCK_H, BLOCK_NOPE, BLOCK_HALF)
    v = tl.arange(0, BLOCK_V)[None, :]
    v_ok = h_ok & (v < VDIM)
    # The query's gradient: no-rope half copied, rope half rotated back into adjacent pairs.
    dq = dq_ptr + b * sdqb + s * sdqs + h * sdqh
    grad_q = grad_q_ptr + pid * heads * (NOPE + 2 * HALF) + h * (NOPE + 2 * HALF)
    tl.store(grad_q + n, tl.load(dq + n, mask=nope_ok), mask=nope_ok)
    g1 = tl.load(dq + NOPE + i[None, :], mask=half_ok, other=0.0).to(tl.float32)
    g2 = tl.load(dq + NOPE + HALF + i[None, :], mask=half_ok, other=0.0).to(tl.float32)
    dtype = grad_q_ptr.dtype.element_ty
    tl.store(grad_q + NOPE + 2 * i[None, :], (g1 * cos[None, :] + g2 * sin[None, :]).to(dtype), mask=half_ok)
    tl.store(grad_q + NOPE + 2 * i[None, :] + 1, (g2 * cos[None, :] - g1 * sin[None, :]).to(dtype), mask=half_ok)
    # kv's gradient in one write: the keys' no-rope parts, then the values'.
    dk = dk_ptr + b * sdkb + s * sdks + h * sdkh
    grad_kv = grad_kv_ptr + pid * heads * (NOPE + VDIM) + h * (NOPE + VDIM)
    tl.store(grad_kv + n, tl.load(dk + n, mask=nope_ok), mask=nope_ok)
    if HAS_DV:
        dv = tl.load(dv_ptr + b * sdvb + s * sdvs + h * sdvh + v, mask=v_ok)
    else:
        dv = tl.zeros((BLOCK_H, BLOCK_V), dtype=dtype)
    tl.store(grad_kv + NOPE + v, dv, mask=v_ok)
    # The shared rope key's gradient: summed over heads (fp32), rotated back.
    k1 = tl.sum(tl.load(dk + NOPE + i[None, :], mask=half_ok, other=0.0).to(tl.float32), 0)
    k2 = tl.sum(tl.load(dk + NOPE + HALF + i[None, :], mask=half_ok, other=0.0).to(tl.float32), 0)
    grad_kr = grad_kr_ptr + pid * 2 * HALF
    tl.store(grad_kr + 2 * i, (k1 * cos + k2 * sin).to(dtype), mask=i_ok)
    tl.store(grad_kr + 2 * i + 1, (k2 * cos - k1 * sin).to(dtype), mask=i_ok)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _blocks(heads: int, nope: int, half: int) -> dict[str, int]:
    return dict(BLOCK_H=triton.next_power_of_2(heads), BLOCK_NOPE=triton.next_power_of_2(nope), BLOCK_HALF=triton.next_power_of_2(half))


class MlaQueryKey(torch.autograd.Function):
    """(q [b, s, H, nope + rope], kv [b, s, H, nope + v], k_rope [b, s, rope], fp32 cos/sin tables,
    position_ids [b, s] or None) -> (q rotated, k assembled, v: a view of kv); see the module doc."""

    @staticmethod
    def forward(ctx, q, kv, k_rope, cos, sin, position_ids):
        b, s, heads, qk_dim = q.shape
        rope = k_rope.shape[-1]
        nope = qk_dim - rope
        q, kv, k_rope = _last_dim_contiguous(q), _last_dim_contiguous(kv), _last_dim_contiguous(k_rope)
        q_out = torch.empty((b, s, heads, qk_dim), dtype=q.dtype, device=q.device)
        k_out = torch.empty_like(q_out)
        pos = position_ids.expand(b, s).contiguous() if position_ids is not None else q  # q: an unused placeholder
        _mla_forward_kernel[(b * s,)](
            q, kv, k_rope, cos, sin, pos, q_out, k_out, s, heads, *q.stride()[:3], *kv.stride()[:3], *k_rope.stride()[:2],
            cos.stride(0), NOPE=nope, HALF=rope // 2, HAS_POS=position_ids is not None, **_blocks(heads, nope, rope // 2),
        )  # fmt: skip
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.shapes = (b, s, heads, nope, rope, kv.shape[-1] - nope)
        return q_out, k_out, kv[..., nope:]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin, position_ids = ctx.saved_tensors
        b, s, heads, nope, rope, v_dim = ctx.shapes
        dq, dk = _last_dim_contiguous(dq), _last_dim_contiguous(dk)
        dv = _last_dim_contiguous(dv) if dv is not None else None
        grad_q = torch.empty((b, s, heads, nope + rope), dtype=dq.dtype, device=dq.device)
        grad_kv = torch.empty((b, s, heads, nope + v_dim), dtype=dq.dtype, device=dq.device)
        grad_kr = torch.empty((b, s, rope), dtype=dq.dtype, device=dq.device)
        pos = position_ids.expand(b, s).contiguous() if position_ids is not None else dq
        dv_strides = dv.stride()[:3] if dv is not None else (0, 0, 0)
        _mla_backward_kernel[(b * s,)](
            dq, dk, dq if dv is None else dv, cos, sin, pos, grad_q, grad_kv, grad_kr, s, heads, *dq.stride()[:3],
            *dk.stride()[:3], *dv_strides, cos.stride(0), NOPE=nope, HALF=rope // 2, VDIM=v_dim,
            HAS_POS=position_ids is not None, HAS_DV=dv is not None, BLOCK_V=triton.next_power_of_2(v_dim),
            **_blocks(heads, nope, rope // 2),
        )  # fmt: skip
        return grad_q, grad_kv, grad_kr, None, None, None
