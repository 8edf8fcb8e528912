"""Multi-head latent attention's fused query/key kernels (``kernels/triton_mla.py``) on the GPU,
at DeepSeek-V2-Lite's attention shape (16 heads, 128 + 64 qk, 128 v, latent 512; 2 x 4096 tokens,
bf16): output and every gradient against the reference path, and the two timed."""

import dataclasses

import pytest
import torch

from meshtron.config import build_config
from meshtron.layers.mla import MultiLatentAttention, rope_table_dim
from meshtron.layers.rope import rope_tables


@pytest.mark.gpu
@pytest.mark.parametrize("positions", ["none", "packed"])
def test_fused_query_key_equals_reference_bf16(positions):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = build_config(None, ["--preset", "deepseek-v2-lite"]).model
    torch.manual_seed(0)
    modules = {mode: MultiLatentAttention(dataclasses.replace(cfg, fused_kernels=mode), 0).cuda().bfloat16() for mode in ("off", "on")}
    modules["on"].load_state_dict(modules["off"].state_dict())
    b, s = 2, 4096
    x = torch.randn(b, s, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(b, s, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    position_ids = None if positions == "none" else (torch.arange(s, device="cuda") % 1000).expand(b, s)
    cos, sin = (t.cuda() for t in rope_tables(cfg, rope_table_dim(cfg), s))
    results, times = {}, {}
    for mode, module in modules.items():
        xi = x.clone().requires_grad_()

        def step(module=module, xi=xi):
            module(xi, cos, sin, position_ids).backward(grad)

        step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            step()
        end.record()
        torch.cuda.synchronize()
        times[mode] = start.elapsed_time(end) / 5
        xi.grad = None
        for p in module.parameters():
            p.grad = None
        out = module(xi, cos, sin, position_ids)
        out.backward(grad)
        results[mode] = {"output": out, "input grad": xi.grad, **{n: p.grad for n, p in module.named_parameters()}}
    errors = {k: ((results["on"][k].float() - v.float()).norm() / v.float().norm()).item() for k, v in results["off"].items()}
    print(f"positions {positions}: fwd+bwd {times['off']:.2f} ms reference, {times['on']:.2f} ms fused; worst error {max(errors.values()):.1e}")
    assert max(errors.values()) < 5e-3, errors
