"""``--moe-shared-expert-overlap`` on the GPU: the shared experts on their own stream give the same
output and gradients, bit for bit, as the same layer run on one stream (the same kernels on the
same inputs; only the order across streams changes)."""

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.layers.moe import MoELayer


@pytest.mark.gpu
def test_shared_expert_overlap_is_bit_identical():
    fields = dict(num_layers=1, hidden_size=1024, num_experts=16, moe_router_topk=4, moe_ffn_hidden_size=512,
                  moe_shared_expert_intermediate_size=1024, add_bias_linear=False, activation="swiglu", moe_router_dtype="fp32")  # fmt: skip
    results = []
    for overlap in (False, True):
        torch.manual_seed(0)
        layer = MoELayer(ModelConfig(**fields, moe_shared_expert_overlap=overlap)).cuda().bfloat16()
        x = torch.randn(4, 2048, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16().requires_grad_()
        out = layer(x)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        results.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
    for plain, overlapped in zip(*results):
        assert torch.equal(plain, overlapped)
