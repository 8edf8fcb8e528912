"""Context parallelism's fused per-block kernels on the GPU, one process (cp 1): each kernel's block
forward (output and log-sum-exp) and its backward from a given output and log-sum-exp against the
fp32 math path, and the ring and all-gather attention against PyTorch's own SDPA, in bf16 with
grouped kv heads. Across ranks the same code is checked by benchmarks/cp_long_context.py.

Tolerance: norm-wise relative error 2e-2 (bf16 inputs and outputs; the math runs in fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.errors import ConfigError
from meshtron.kernels import platform
from meshtron.parallel.context_parallel import (
    _block_backward,
    _block_forward,
    _block_mask,
    _grouped_kv,
    _grouped_q,
    _ungroup,
    allgather_kv_attention,
    ring_attention,
)
from meshtron.parallel.cp_block_kernels import BLOCK_KERNELS
from meshtron.parallel.mesh import Mesh

HEADS, KV_HEADS, HEAD_DIM, TOL = 8, 2, 128, 2e-2
# The kernels this platform has: no cuDNN attention on ROCm.
KERNELS = [k for k in sorted(BLOCK_KERNELS) if k != "cudnn" or platform.cudnn_attention()]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _qkv(s_q: int, s_k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, s_q, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(2, s_k, KV_HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16() for _ in range(2))
    dout = torch.randn(2, s_q, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
    return q, k, v, dout


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("diagonal,s_q,s_k", [(True, 512, 512), (False, 256, 768)])
def test_block_kernel_matches_math(kernel, diagonal, s_q, s_k):
    q, k, v, dout = _qkv(s_q, s_k)
    scale = HEAD_DIM**-0.5
    mask = _block_mask(None, None, diagonal, s_q, s_k, q.device)
    q5, k5, v5 = _grouped_q(q, KV_HEADS), _grouped_kv(k), _grouped_kv(v)
    want_out, want_lse = _block_forward(q5, k5, v5, mask, scale)
    fused = BLOCK_KERNELS[kernel]
    out, lse, aux = fused.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), diagonal, scale)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, HEADS, s_q)
    assert _rel(out.transpose(1, 2), _ungroup(want_out, torch.float32)) < TOL
    assert _rel(lse, want_lse.flatten(1, 2)) < 1e-3
    # Backward from the kernel's own output and log-sum-exp (as the ring hands it the merged ones).
    out_bshd = out.transpose(1, 2)
    delta = (_grouped_q(dout, KV_HEADS) * _grouped_q(out_bshd, KV_HEADS)).sum(-1)
    lse5 = lse.reshape(2, KV_HEADS, HEADS // KV_HEADS, s_q)
    want = _block_backward(q5, k5, v5, mask, scale, _grouped_q(dout, KV_HEADS), lse5, delta)
    got = fused.backward(dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out, lse.contiguous(), aux, diagonal, scale)
    assert _rel(got[0].transpose(1, 2), _ungroup(want[0], torch.float32)) < TOL, "dq"
    assert _rel(got[1], want[1].squeeze(2)) < TOL, "dk"
    assert _rel(got[2], want[2].squeeze(2)) < TOL, "dv"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("attention", [ring_attention, allgather_kv_attention])
def test_cp1_attention_matches_sdpa(kernel, attention):
    q, k, v, dout = _qkv(1024, 1024, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    got = attention(q, k, v, Mesh(), causal=True, kernel=kernel)
    got_grads = torch.autograd.grad(got, (q, k, v), dout)
    want = F.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    want_grads = torch.autograd.grad(want, (q, k, v), dout.float())
    assert got.dtype == torch.bfloat16 and _rel(got, want) < TOL
    for name, a, b in zip("qkv", got_grads, want_grads):
        assert _rel(a, b) < TOL, f"d{name}"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("attention", [ring_attention, allgather_kv_attention])
def test_blocks_take_mla_head_dims(attention, kernel):
    """Multi-head latent attention's shape: q/k heads 192 wide, values 128, its own softmax scale,
    through the cuDNN blocks as they are and the flash blocks with values zero-padded; values
    wider than q/k are refused by name."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k = (torch.randn(2, 1024, 16, 192, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(2, 1024, 16, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    dout = torch.randn(2, 1024, 16, 128, device="cuda", generator=g).bfloat16()
    scale = 0.1147  # DeepSeek-V2's: 1/sqrt(192) times YaRN's temperature squared
    got = attention(q, k, v, Mesh(), causal=True, kernel=kernel, scale=scale)
    got_grads = torch.autograd.grad(got, (q, k, v), dout)
    want = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=scale).transpose(1, 2)
    want_grads = torch.autograd.grad(want, (q, k, v), dout.float())
    assert got.shape == v.shape and _rel(got, want) < TOL
    for name, a, b in zip("qkv", got_grads, want_grads):
        assert _rel(a, b) < TOL, f"d{name}"
    if kernel == "flash":
        with pytest.raises(ConfigError, match="at most as wide"):
            attention(v, v, q, Mesh(), causal=True, kernel="flash", scale=scale)
