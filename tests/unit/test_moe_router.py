"""MoE router: each routing rule against hand-computed weights, and the expert bias."""

import math

import torch

from meshtron.config import ModelConfig
from meshtron.layers.moe.router import Router, group_limited_topk, topk_routing

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.0]])


def _sig(v: float) -> float:
    return 1 / (1 + math.exp(-v))


def _as_dict(probs, experts) -> dict[int, float]:
    return {int(e): float(p) for e, p in zip(experts[0], probs[0])}


def test_softmax_after_topk_renormalizes_over_the_chosen():
    probs, experts = topk_routing(LOGITS, 2)
    e = math.e
    assert _as_dict(probs, experts) == {1: torch.tensor(e / (e + 1)).item(), 2: torch.tensor(1 / (e + 1)).item()}


def test_pre_softmax_keeps_full_softmax_probabilities():
    probs, experts = topk_routing(LOGITS, 2, pre_softmax=True)
    z = sum(math.exp(v) for v in (1, 3, 2, 0))
    got = _as_dict(probs, experts)
    assert set(got) == {1, 2}
    assert math.isclose(got[1], math.exp(3) / z, rel_tol=1e-6) and math.isclose(got[2], math.exp(2) / z, rel_tol=1e-6)


def test_sigmoid_renormalizes_when_k_above_one_and_scaling_multiplies():
    probs, experts = topk_routing(LOGITS, 2, score_function="sigmoid", scaling_factor=2.5)
    got = _as_dict(probs, experts)
    total = _sig(3) + _sig(2)
    assert math.isclose(got[1], 2.5 * _sig(3) / total, rel_tol=1e-6) and math.isclose(got[2], 2.5 * _sig(2) / total, rel_tol=1e-6)
    probs, experts = topk_routing(LOGITS, 1, score_function="sigmoid")
    assert _as_dict(probs, experts) == {1: torch.tensor(_sig(3)).item()}


def test_expert_bias_changes_the_choice_not_the_weights():
    bias = torch.tensor([5.0, 0.0, 0.0, 0.0])
    probs, experts = topk_routing(LOGITS, 2, score_function="sigmoid", expert_bias=bias)
    got = _as_dict(probs, experts)
    assert set(got) == {0, 1}
    assert math.isclose(got[0], _sig(1) / (_sig(1) + _sig(3)), rel_tol=1e-6)


def test_group_limited_routing_picks_only_from_the_best_groups():
    # 3 groups of 2; a group scores by its best k // group_topk = 2 experts: 10, 12, 8 -> group 1.
    scores = torch.tensor([[10.0, 0.0, 6.0, 6.0, 7.0, 1.0]])
    assert set(scores.topk(2).indices[0].tolist()) == {0, 4}  # what ungrouped top-2 would take
    _, experts = group_limited_topk(scores, 2, num_groups=3, group_topk=1)
    assert set(experts[0].tolist()) == {2, 3}
    probs, experts = topk_routing(scores, 2, num_groups=3, group_topk=1)  # groups scored on the logits
    assert set(experts[0].tolist()) == {2, 3}
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.5]))
    _, experts = topk_routing(scores, 2, score_function="sigmoid", num_groups=3, group_topk=1)
    assert set(experts[0].tolist()) == {2, 3}  # sigmoid: 1.5, 1.995, 1.73


def test_group_scored_by_its_best_expert():
    """DeepSeek-V2's rule: the same scores pick group 0 (best 10) where the sum of the best two picks group 1."""
    scores = torch.tensor([[10.0, 0.0, 6.0, 6.0, 7.0, 1.0]])
    _, experts = group_limited_topk(scores, 2, num_groups=3, group_topk=1, group_score="max")
    assert set(experts[0].tolist()) == {0, 1}
    _, experts = topk_routing(scores, 2, num_groups=3, group_topk=2, group_score="max")  # groups 0 and 2
    assert set(experts[0].tolist()) == {0, 4}


def _router(**fields) -> Router:
    return Router(ModelConfig(hidden_size=8, num_experts=4, add_bias_linear=False, **fields))


def test_jitter_only_in_training_and_router_dtype():
    torch.manual_seed(0)
    router = _router(moe_jitter_eps=0.1, moe_router_dtype="fp64")
    x = torch.randn(5, 8)
    router.eval()
    expected = x.double() @ router.weight.double().t()
    torch.testing.assert_close(router(x).logits, expected)
    router.train()
    assert not torch.allclose(router(x).logits, expected)


def test_expert_bias_update_lowers_overloaded_experts_and_stays_fp32():
    router = _router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    router.to(torch.bfloat16)
    assert router.expert_bias.dtype == torch.float32 and router.weight.dtype == torch.bfloat16
    router.update_expert_bias(torch.tensor([10, 0, 2, 4]))  # mean 4
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.0]))
    assert "expert_bias" in router.state_dict()


def test_forced_load_balancing_routes_evenly_whatever_the_gate_and_passes_its_gradient_through():
    cfg = ModelConfig(hidden_size=8, num_experts=4, moe_router_topk=2, moe_router_force_load_balancing=True)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0] = 10.0  # the gate alone would send every token to expert 0
    tokens = torch.ones(4000, 8, requires_grad=True)
    routing = router(tokens)
    counts = torch.bincount(routing.experts.reshape(-1), minlength=4)
    assert counts.min() > 0.9 * 2000 and counts.max() < 1.1 * 2000  # T*k/E = 2000 each
    routing.probs[:, 0].sum().backward()  # not the sum of both: that is 1 for every token
    assert router.weight.grad.abs().sum() > 0 and tokens.grad.abs().sum() > 0
