"""``--qk-layernorm`` in standard attention on the GPU, at Qwen3-30B-A3B's attention shape (32
heads, 4 kv groups, head_dim 128; 2 x 2048 tokens, bf16): the fused norm and RoPE kernels against
the reference path, output and every gradient (the per-head norms' weights included)."""

import dataclasses

import pytest
import torch

from meshtron.config import build_config
from meshtron.layers.attention import Attention, head_dim
from meshtron.layers.rope import rope_tables


@pytest.mark.gpu
def test_qk_layernorm_fused_equals_reference_bf16():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = build_config(None, ["--preset", "qwen3-30b-a3b"]).model
    torch.manual_seed(0)
    modules = {mode: Attention(dataclasses.replace(cfg, fused_kernels=mode), 0).cuda().bfloat16() for mode in ("off", "on")}
    with torch.no_grad():  # norms away from their init of ones, so that a dropped weight shows
        for module in modules.values():
            module.q_layernorm.weight.copy_(torch.linspace(0.5, 1.5, head_dim(cfg)))
            module.k_layernorm.weight.copy_(torch.linspace(1.5, 0.5, head_dim(cfg)))
    modules["on"].load_state_dict(modules["off"].state_dict())
    b, s = 2, 2048
    x = torch.randn(b, s, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(b, s, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    cos, sin = (t.cuda() for t in rope_tables(cfg, head_dim(cfg), s))
    results = {}
    for mode, module in modules.items():
        inp = x.clone().requires_grad_()
        out = module(inp, cos, sin)
        out.backward(grad)
        results[mode] = [out, inp.grad] + [p.grad for p in module.parameters()]
    for got, want in zip(results["on"], results["off"]):
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < 2e-2, error
