"""The gather-form permute / combine kernels against the reference ops on the CPU, through
Triton's interpreter (fp32): outputs and every gradient (tokens, combine weights, expert weights).

fp32 sums in a different order than the reference's ``index_add``: agreement to 1e-5 relative.
Skipped where Triton is not installed and where a GPU is present (tests/gpu runs them compiled,
in bf16), as in test_kernels_triton.py.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from meshtron.kernels import triton_available

pytestmark = pytest.mark.skipif(
    not triton_available() or torch.cuda.is_available(), reason="needs Triton, and no GPU (then tests/gpu covers it)"
)
if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from meshtron.config import ModelConfig  # noqa: E402
from meshtron.layers.moe import MoELayer  # noqa: E402
from meshtron.layers.moe.dispatch import permute, plan_dispatch, unpermute  # noqa: E402
from meshtron.layers.moe.grouped_gemm import grouped_mm_loop  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


def _routing(case: str, num_tokens: int, topk: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Expert ids [T, k], distinct per token."""
    if case == "ties":  # every token picks the same k experts: T-long runs of one expert id
        return torch.arange(topk).repeat(num_tokens, 1)
    if case == "empty experts":  # only the even experts are ever chosen
        scores = torch.rand(num_tokens, num_experts // 2, generator=gen)
        return scores.topk(topk, dim=1).indices * 2
    return torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=1).indices


def _dispatch_and_combine(mode: str, tokens, probs, weight, experts, num_experts):
    """Plan, permute, a per-expert nonlinear map (so that each row's gradient depends on its
    expert), combine; under the kernels (``on``) or the reference (``off``)."""
    plan = plan_dispatch(probs, experts, num_experts, fused_kernels=mode)
    rows = permute(tokens, plan, mode)
    expert_output = F.gelu(grouped_mm_loop(rows, weight, plan.group_sizes))
    return unpermute(expert_output, plan, tokens.shape[0], tokens.dtype, mode)


@pytest.mark.parametrize(
    "case,num_tokens,topk,num_experts,hidden",
    [("random", 13, 3, 8, 40), ("ties", 9, 2, 4, 24), ("empty experts", 11, 2, 8, 33), ("k=1", 10, 1, 4, 16),
     ("wide", 5, 6, 16, 1100)],  # several column blocks; k = 6 padded to a tile of 8
)  # fmt: skip
def test_kernels_match_reference_fp32(case, num_tokens, topk, num_experts, hidden):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + hidden)
    experts = _routing(case, num_tokens, topk, num_experts, gen)
    inputs = (torch.randn(num_tokens, hidden, generator=gen), torch.rand(num_tokens, topk, generator=gen),
              torch.randn(num_experts, hidden, hidden, generator=gen) * hidden**-0.5)  # fmt: skip
    upstream = torch.randn(num_tokens, hidden, generator=gen)
    results = []
    for mode in ("on", "off"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = _dispatch_and_combine(mode, *leaves[:2], leaves[2], experts, num_experts)
        results.append([out, *torch.autograd.grad(out, leaves, upstream)])
    for name, got, want in zip(("output", "tokens grad", "weights grad", "expert grad"), *results):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{case} {name}: {m}")


@pytest.mark.parametrize("case,num_tokens,topk,num_experts", [("random", 300, 6, 64), ("ties", 40, 3, 8), ("empty experts", 70, 2, 300),
                                                          ("more blocks than a scan chunk", 1500, 4, 256)])
def test_kernel_plan_is_the_reference_plan_bit_for_bit(case, num_tokens, topk, num_experts):
    """Several blocks of copies (300 x 6 at 64 experts: 15 blocks of 128), runs of one expert, empty
    experts, a width that is not a power of two; then the reference's copies read from the
    kernel's plan."""
    gen = torch.Generator().manual_seed(num_tokens)
    experts = _routing(case, num_tokens, topk, num_experts, gen)
    probs = torch.rand(num_tokens, topk, generator=gen)
    kernel, reference = (plan_dispatch(probs, experts, num_experts, fused_kernels=mode) for mode in ("on", "off"))
    assert kernel.order is None and torch.equal(kernel.inverse, reference.inverse)
    assert torch.equal(kernel.group_sizes, reference.group_sizes) and kernel.group_sizes.dtype == reference.group_sizes.dtype
    assert torch.equal(kernel.token_index, reference.token_index) and torch.equal(kernel.weights, reference.weights)


def test_combine_without_weight_gradient_and_to_a_narrower_dtype():
    """Detached weights skip the dot products; the output is the fp32 sum cast once to the requested
    dtype (to within one bf16 step: Triton's interpreter truncates where a GPU rounds)."""
    gen = torch.Generator().manual_seed(3)
    experts = _routing("random", 7, 2, 4, gen)
    plan = plan_dispatch(torch.rand(7, 2, generator=gen), experts, 4)
    rows = torch.randn(14, 24, generator=gen, requires_grad=True)
    out = unpermute(rows, plan, 7, torch.bfloat16, "on")
    reference = unpermute(rows, plan, 7, None, "off")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=0, rtol=2**-7)
    (grad,) = torch.autograd.grad(out.float().sum(), rows)
    torch.testing.assert_close(grad, plan.weights[:, None].expand(14, 24), atol=0, rtol=0)


@pytest.mark.parametrize("capacity_factor", [0.0, 0.75])
def test_moe_layer_with_kernels_equals_reference(capacity_factor):
    """The whole layer, fused_kernels on vs off: output and every parameter's and the input's
    gradient (with a capacity factor both take the reference ops: the plan has no ``inverse``)."""
    results = []
    for mode in ("on", "off"):
        torch.manual_seed(0)
        cfg = ModelConfig(num_layers=2, hidden_size=24, num_experts=6, moe_router_topk=3, moe_ffn_hidden_size=16,
                          add_bias_linear=False, activation="swiglu", moe_router_dtype="fp32", fused_kernels=mode,
                          moe_expert_capacity_factor=capacity_factor, moe_shared_expert_intermediate_size=8,
                          moe_aux_loss_coeff=0.01)  # fmt: skip
        layer = MoELayer(cfg)
        x = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = layer(x)
        (y.square().sum() + sum(layer.last_aux_losses.values())).backward()
        results.append([y, x.grad, *(p.grad for p in layer.parameters())])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **TOL)


def test_moe_layer_with_kernels_under_torch_compile():
    """torch.compile runs the kernels eagerly (a graph break, not traced): same output and input
    gradient as eager. GELU experts: the SwiGLU kernel is traced by dynamo, which the interpreter
    cannot be (a GPU compiles it)."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=24, num_experts=6, moe_router_topk=3, moe_ffn_hidden_size=16,
                      add_bias_linear=False, activation="gelu", moe_router_dtype="fp32", fused_kernels="on",
                      moe_grouped_gemm="loop")  # fmt: skip
    layer = MoELayer(cfg)
    x = torch.randn(2, 5, 24, requires_grad=True)
    outputs = []
    for run in (layer, torch.compile(layer, backend="aot_eager")):
        y = run(x)
        outputs.append((y, *torch.autograd.grad(y.square().sum(), x)))
    for got, want in zip(*outputs):
        torch.testing.assert_close(got, want, **TOL)
