"""The gather-form permute / combine kernels against the reference ops on the GPU, in bf16, at
DeepSeek-V2-Lite's layer shape (8192 tokens, 64 experts top-6, hidden 2048, fp32 router weights),
and their speed: plan + permute + combine, forward and backward, old (reference) vs new.

    pytest -q -s -m gpu tests/gpu/test_moe_permute_gpu.py

Errors are norm-wise relative. The output and the combine weights' gradient differ from the
reference only by the order of fp32 sums; the tokens' gradient also by the reference's bf16
``index_add`` (each add rounded), which the kernel sums in fp32 and rounds once.
"""

import pytest
import torch

from meshtron.kernels.checks import relative_error
from meshtron.layers.moe.dispatch import permute, plan_dispatch, unpermute

TOKENS, EXPERTS, TOPK, HIDDEN = 8192, 64, 6, 2048


def _inputs(seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(TOKENS, EXPERTS, device="cuda", generator=gen) * 2
    probs, experts = torch.softmax(logits, dim=-1).topk(TOPK, dim=1)
    tokens = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    upstream = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    return tokens, probs, experts, upstream


def _step(mode: str, tokens, probs, experts, upstream):
    """Plan, permute, combine (as the layer calls them, experts left out), forward and backward."""
    tokens.grad = probs.grad = None
    plan = plan_dispatch(probs, experts, EXPERTS, fused_kernels=mode)
    out = unpermute(permute(tokens, plan, mode), plan, TOKENS, tokens.dtype, mode)
    out.backward(upstream)
    return out


def _time_ms(fn, steps: int = 20) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


@pytest.mark.gpu
def test_permute_kernels_match_reference_bf16_and_time_them():
    tokens, probs, experts, upstream = _inputs()
    results = {}
    for mode in ("on", "off"):
        leaves = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        out = _step(mode, *leaves, experts, upstream)
        results[mode] = (out, *(t.grad for t in leaves))
    errors = [relative_error(a, b) for a, b in zip(results["on"], results["off"])]
    print(f"\nbf16 relative error, new vs reference: output {errors[0]:.1e}, tokens grad {errors[1]:.1e}, weights grad {errors[2]:.1e}")
    assert errors[0] < 1e-2 and errors[1] < 1e-2 and errors[2] < 1e-3, errors

    times = {}
    for mode in ("off", "on"):
        leaves = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        times[mode] = _time_ms(lambda: _step(mode, *leaves, experts, upstream))
    with torch.no_grad():
        plan_ms = {mode: _time_ms(lambda: plan_dispatch(probs, experts, EXPERTS, fused_kernels=mode)) for mode in ("off", "on")}
        assert torch.equal(plan_dispatch(probs, experts, EXPERTS, fused_kernels="on").inverse,
                           plan_dispatch(probs, experts, EXPERTS, fused_kernels="off").inverse)  # fmt: skip
    print(f"dispatch fwd+bwd (plan, permute, combine) at {TOKENS} x top-{TOPK} x {HIDDEN} bf16: "
          f"reference {times['off']:.3f} ms, kernels {times['on']:.3f} ms (plan alone {plan_ms['off']:.3f} / {plan_ms['on']:.3f} ms)")  # fmt: skip
    assert times["on"] < times["off"]


@pytest.mark.gpu
def test_plan_kernels_at_deepseek_v3_size():
    """DeepSeek-V3's router (256 experts, top-8) over a 16 K-token micro batch: 1,024 blocks of
    copies, past where the plan's rows kernel once summed every earlier block. The kernels' plan
    equals the reference's stable sort and is not slower than it."""
    tokens, experts_n, topk = 16384, 256, 8
    gen = torch.Generator(device="cuda").manual_seed(1)
    probs, experts = torch.softmax(torch.randn(tokens, experts_n, device="cuda", generator=gen), -1).topk(topk, dim=1)
    with torch.no_grad():
        on, off = (plan_dispatch(probs, experts, experts_n, fused_kernels=mode) for mode in ("on", "off"))
        assert torch.equal(on.inverse, off.inverse) and torch.equal(on.group_sizes, off.group_sizes)
        plan_ms = {mode: _time_ms(lambda: plan_dispatch(probs, experts, experts_n, fused_kernels=mode)) for mode in ("off", "on")}
    print(f"\nplan at {tokens} x top-{topk} x {experts_n} experts: reference {plan_ms['off']:.3f} ms, kernels {plan_ms['on']:.3f} ms")
    assert plan_ms["on"] <= plan_ms["off"]
