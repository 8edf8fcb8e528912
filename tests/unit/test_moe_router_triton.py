"""The fused router kernel against its reference on the CPU, through Triton's interpreter (fp32):
combine weights, chosen experts, balancing and z losses, and the gradients of the tokens and the
gate (``meshtron.kernels.checks.router_checks``); the router takes it only where it applies.

Skipped where Triton is not installed and where a GPU is present (tests/gpu runs the same checks
compiled, in bf16 and at DeepSeek-V2-Lite's shape), as in test_kernels_triton.py.
"""

import os

import pytest
import torch

from meshtron.kernels import triton_available

pytestmark = pytest.mark.skipif(
    not triton_available() or torch.cuda.is_available(), reason="needs Triton, and no GPU (then tests/gpu covers it)"
)
if triton_available() and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from meshtron.config import ModelConfig  # noqa: E402
from meshtron.kernels.checks import relative_error, router_checks  # noqa: E402
from meshtron.layers.moe import MoELayer  # noqa: E402
from meshtron.layers.moe.router import Router  # noqa: E402


def test_fused_router_matches_reference_fp32():
    results = router_checks("cpu", torch.float32)
    assert len(results) == 4
    for r in results:
        assert r.forward < 1e-6 and r.backward < 1e-5, r


def _cfg(**fields) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=16, num_experts=6, moe_router_topk=2, moe_ffn_hidden_size=8,
                       add_bias_linear=False, activation="swiglu", **fields)  # fmt: skip


@pytest.mark.parametrize(
    "fields,fused",
    [({}, True), ({"fused_kernels": "off"}, False), ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, False),
     ({"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}, False),
     ({"moe_router_load_balancing_type": "sinkhorn"}, False)],
    ids=["plain", "kernels off", "groups", "expert bias", "sinkhorn"],
)  # fmt: skip
def test_router_takes_the_kernel_only_where_it_applies(fields, fused):
    router = Router(_cfg(**{"fused_kernels": "on", **fields}))
    logits = torch.randn(128, 6)
    assert router._fusable(logits, rows=1) is fused
    assert router._fusable(logits, rows=3) is False  # 128 / 3 tokens per sequence: a program would span two


@pytest.mark.parametrize(
    "fields",
    [dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-2, moe_router_pre_softmax=True),
     dict(moe_router_load_balancing_type="none", moe_router_score_function="sigmoid")],
    ids=["seq aux + z", "no losses, sigmoid"],
)  # fmt: skip
def test_moe_layer_with_the_fused_router_equals_the_reference(fields):
    """The whole layer, kernels on (router, dispatch) vs off: output, losses, gradients."""
    outputs = []
    for mode in ("on", "off"):
        torch.manual_seed(0)
        layer = MoELayer(_cfg(fused_kernels=mode, **fields))
        x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = layer(x)
        loss = out.square().sum() + sum(layer.last_aux_losses.values(), torch.zeros(()))
        loss.backward()
        outputs.append((out, loss, x.grad, [p.grad for p in layer.parameters()]))
    (out, loss, gx, gp), (ref_out, ref_loss, ref_gx, ref_gp) = outputs
    for name, a, b in [("output", out, ref_out), ("loss", loss, ref_loss), ("input grad", gx, ref_gx)] + [
        (f"grad {n}", g, r) for (n, _), g, r in zip(layer.named_parameters(), gp, ref_gp)
    ]:
        assert relative_error(a, b) < 1e-5, (name, relative_error(a, b))  # normwise: the gradients are small
