"""The MoE layer against a token-by-token dense reference: dropless, grouped GEMM, capacity, shared experts."""


import pytest
import torch
import torch.nn.functional as F

from meshtron.config import ModelConfig
from meshtron.layers.moe import MoELayer
from meshtron.layers.moe.dispatch import expert_capacity, permute, plan_dispatch, unpermute
from meshtron.layers.moe.grouped_gemm import _grouped_mm_runs, grouped_mm, grouped_mm_loop, torch_grouped_mm_usable

H, FFN, E, K = 16, 8, 4, 2


def _layer(seed: int = 0, **fields) -> MoELayer:
    torch.manual_seed(seed)
    defaults = dict(num_layers=2, hidden_size=H, num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FFN,
                    add_bias_linear=False, activation="swiglu")  # fmt: skip
    layer = MoELayer(ModelConfig(**{**defaults, **fields})).eval()
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)  # decisive routing, no near-ties
    return layer


def _expert(layer: MoELayer, e: int, token: torch.Tensor) -> torch.Tensor:
    hidden = layer.experts.weight1[e] @ token
    if layer.cfg.activation == "swiglu":
        gate, up = hidden.chunk(2)
        hidden = F.silu(gate) * up
    else:
        hidden = F.gelu(hidden)
    return layer.experts.weight2[e] @ hidden


def _reference(layer: MoELayer, x: torch.Tensor, kept=lambda token, expert: True) -> torch.Tensor:
    """Every token through each of its top-k experts explicitly, weighted and summed."""
    tokens = x.reshape(-1, H)
    routing = layer.router(tokens)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for p, e in zip(routing.probs[t], routing.experts[t].tolist()):
            if kept(t, e):
                out[t] += p * _expert(layer, e, tokens[t])
    return out.view_as(x)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("backend", ["loop", "auto"])
def test_dropless_layer_equals_token_by_token_reference(activation, backend):
    layer = _layer(activation=activation, moe_grouped_gemm=backend)
    x = torch.randn(2, 5, H)
    y, expected = layer(x), _reference(layer, x)
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=1e-6)
    grads = [torch.autograd.grad(out.square().sum(), list(layer.parameters())) for out in (y, expected)]
    for got, want in zip(*grads):  # the router's gradient comes through the combine weights
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not torch_grouped_mm_usable(torch.zeros(1, H), torch.zeros(E, FFN, H)), reason="no torch._grouped_mm")
def test_grouped_gemm_equals_loop_forward_and_backward():
    outputs, grads = [], []
    for backend in ("loop", "torch"):
        layer = _layer(moe_grouped_gemm=backend, moe_aux_loss_coeff=0.01).train()
        x = torch.randn(3, 7, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = layer(x)
        (y.square().sum() + layer.last_aux_losses["load_balancing"]).backward()
        outputs.append(y)
        grads.append([x.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-6, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["loop", "auto"])
def test_experts_with_zero_tokens(backend):
    layer = _layer(moe_grouped_gemm=backend)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:2] = 1.0  # positive inputs: experts 0 and 1 always win
    x = torch.rand(2, 3, H, requires_grad=True) + 0.1
    y = layer(x)
    assert layer.last_tokens_per_expert.tolist() == [6, 6, 0, 0]
    torch.testing.assert_close(y, _reference(layer, x), atol=1e-6, rtol=1e-6)
    y.sum().backward()
    assert layer.experts.weight1.grad[2:].abs().sum() == 0 and layer.experts.weight1.grad[:2].abs().sum() > 0
    empty = grouped_mm(torch.zeros(0, H), layer.experts.weight1.detach(), torch.zeros(E, dtype=torch.long), backend)
    assert empty.shape == (0, 2 * FFN)


def test_grouped_mm_backends_agree_on_ragged_groups():
    x, weight = torch.randn(10, H), torch.randn(E, 12, H)
    sizes = torch.tensor([3, 0, 7, 0])
    expected = torch.cat([x[:3] @ weight[0].t(), x[3:10] @ weight[2].t()])
    torch.testing.assert_close(grouped_mm_loop(x, weight, sizes), expected)
    torch.testing.assert_close(grouped_mm(x, weight, sizes, "auto"), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm")
def test_grouped_mm_probe_from_inference_mode_still_finds_it():
    _grouped_mm_runs.cache_clear()
    layer = _layer()
    with torch.inference_mode():
        y = layer(torch.randn(1, 3, H))
    assert _grouped_mm_runs(y.device, y.dtype)


@pytest.mark.parametrize("num_experts", [8, 300])  # uint8 and int32 sort keys
def test_dropless_plan_sorts_copies_stably_and_inverts_the_sort(num_experts):
    gen = torch.Generator().manual_seed(2)
    experts = torch.rand(50, num_experts, generator=gen).topk(3, dim=1).indices
    experts[:10] = torch.tensor([0, 5, 7])  # ties: ten tokens on the same three experts
    probs = torch.rand(50, 3, generator=gen)
    plan = plan_dispatch(probs, experts, num_experts)
    flat = experts.reshape(-1)
    assert plan.group_sizes.tolist() == torch.bincount(flat, minlength=num_experts).tolist()
    order = torch.argsort(flat, stable=True)
    assert torch.equal(plan.token_index, order // 3) and torch.equal(plan.weights, probs.reshape(-1)[order])
    # inverse[t, j]: the row holding token t's j-th copy
    assert torch.equal(plan.token_index[plan.inverse], torch.arange(50)[:, None].expand(50, 3))
    assert torch.equal(plan.weights[plan.inverse], probs) and plan.token_weights is probs


def test_capacity_drops_by_probability_or_by_position():
    # 2 sequences of 3 tokens, top-1; capacity = ceil(6 * 1 / 2 * 1.0) = 3.
    experts = torch.tensor([[0], [0], [0], [0], [0], [1]])
    probs = torch.tensor([[0.5], [0.9], [0.1], [0.7], [0.3], [0.8]])
    assert expert_capacity(6, 1, 2, 1.0) == 3
    by_probs = plan_dispatch(probs, experts, 2, capacity_factor=1.0, drop_policy="probs", seq_length=3)
    assert sorted(by_probs.token_index.tolist()) == [0, 1, 3, 5]
    assert by_probs.tokens_per_expert.tolist() == [3, 1]
    # Position order is position-major: t0, t3 (position 0), t1, t4 (1), t2, t5 (2).
    by_position = plan_dispatch(probs, experts, 2, capacity_factor=1.0, drop_policy="position", seq_length=3)
    assert sorted(by_position.token_index.tolist()) == [0, 1, 3, 5]
    experts[3] = 1  # now expert 0 holds t0, t1, t2, t4: position order t0, t1, t4, t2
    by_position = plan_dispatch(probs, experts, 2, capacity_factor=1.0, drop_policy="position", seq_length=3)
    assert sorted(by_position.token_index.tolist()) == [0, 1, 3, 4, 5]


def test_padding_to_capacity_gives_static_rows_and_the_same_output():
    torch.manual_seed(4)
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    probs = torch.rand(4, 2)
    plain = plan_dispatch(probs, experts, E, capacity_factor=0.5)
    padded = plan_dispatch(probs, experts, E, capacity_factor=0.5, pad_to_capacity=True)
    capacity = expert_capacity(4, 2, E, 0.5)
    assert capacity == 1 and padded.num_rows == E * capacity and padded.group_sizes.tolist() == [1] * E
    assert plain.tokens_per_expert.tolist() == padded.tokens_per_expert.tolist() == [1, 1, 1, 1]
    tokens = torch.randn(4, H)
    weight = torch.randn(E, H, H)
    out_plain = unpermute(grouped_mm_loop(permute(tokens, plain), weight, plain.group_sizes), plain, 4)
    out_padded = unpermute(grouped_mm_loop(permute(tokens, padded), weight, padded.group_sizes), padded, 4)
    torch.testing.assert_close(out_plain, out_padded)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_layer_equals_reference_without_the_dropped_copies(policy):
    layer = _layer(moe_expert_capacity_factor=0.75, moe_token_drop_policy=policy)
    b, s = 2, 6
    x = torch.randn(b, s, H)
    with torch.no_grad():
        routing = layer.router(x.reshape(-1, H))
    capacity = expert_capacity(b * s, K, E, 0.75)
    kept = set()
    for e in range(E):
        copies = [(t, float(p)) for t in range(b * s) for p, ex in zip(routing.probs[t], routing.experts[t]) if ex == e]
        if policy == "probs":
            copies.sort(key=lambda c: -c[1])
        else:
            copies.sort(key=lambda c: (c[0] % s, c[0] // s))
        kept.update((t, e) for t, _ in copies[:capacity])
    assert len(kept) < b * s * K  # something was dropped
    y = layer(x)
    torch.testing.assert_close(y, _reference(layer, x, kept=lambda t, e: (t, e) in kept), atol=1e-6, rtol=1e-6)
    assert layer.last_tokens_per_expert.sum() == len(kept)
    padded = _layer(moe_expert_capacity_factor=0.75, moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=True)
    torch.testing.assert_close(padded(x), y, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("gate", [False, True])
def test_shared_experts_add_a_dense_mlp(gate):
    layer = _layer(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=gate)
    assert layer.shared_experts.linear_fc1.weight.shape == (48, H)
    x = torch.randn(2, 3, H)
    shared = layer.shared_experts(x)
    if gate:
        shared = shared * torch.sigmoid(x @ layer.shared_expert_gate.weight.t())
    torch.testing.assert_close(layer(x), _reference(layer, x) + shared, atol=1e-6, rtol=1e-6)


def test_bf16_layer_runs_and_stays_close_to_fp32():
    layer = _layer(moe_router_dtype="fp32")
    x = torch.randn(2, 4, H)
    expected = layer(x)
    y = layer.to(torch.bfloat16)(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.05)
