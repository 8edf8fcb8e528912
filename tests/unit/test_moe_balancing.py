"""MoE balancing losses against direct transcriptions of their formulas."""

import math

import torch

from meshtron.config import ModelConfig
from meshtron.layers.moe import MoELayer
from meshtron.layers.moe.balancing import aux_loss_coeff, losses_from_statistics, statistics_needed, token_statistics


def balancing_losses(logits, batch_size, topk, score_function, balancing_type, aux_coeff, z_coeff):
    """A layer's named losses from its router logits, as the MoE layer computes them (reference path)."""
    needed = statistics_needed(balancing_type, aux_coeff, z_coeff)
    return losses_from_statistics(token_statistics(logits, batch_size, topk, score_function, needed), topk, aux_coeff, z_coeff)


def _switch_loss_by_hand(probs: list[list[float]], chosen: list[list[int]]) -> float:
    """E * sum_i f_i * P_i with f_i = share of the T*k choices, P_i = mean probability."""
    tokens, experts, k = len(probs), len(probs[0]), len(chosen[0])
    f = [sum(i in c for c in chosen) / (tokens * k) for i in range(experts)]
    p = [sum(row[i] for row in probs) / tokens for i in range(experts)]
    return experts * sum(fi * pi for fi, pi in zip(f, p))


def test_aux_loss_matches_formula():
    torch.manual_seed(0)
    logits = torch.randn(6, 4)
    probs = torch.softmax(logits, -1)
    chosen = probs.topk(2).indices.tolist()
    losses = balancing_losses(logits, 2, 2, "softmax", "aux_loss", aux_coeff=0.1, z_coeff=0.0)
    assert set(losses) == {"load_balancing"}
    assert math.isclose(losses["load_balancing"].item(), 0.1 * _switch_loss_by_hand(probs.tolist(), chosen), rel_tol=1e-6)


def test_aux_loss_with_sigmoid_uses_normalized_scores():
    torch.manual_seed(1)
    logits = torch.randn(5, 4)
    scores = torch.sigmoid(logits)
    scores = scores / scores.sum(-1, keepdim=True)
    loss = balancing_losses(logits, 1, 2, "sigmoid", "aux_loss", aux_coeff=1.0, z_coeff=0.0)["load_balancing"]
    assert math.isclose(loss.item(), _switch_loss_by_hand(scores.tolist(), scores.topk(2).indices.tolist()), rel_tol=1e-6)


def test_uniform_router_gives_aux_loss_equal_to_its_coefficient():
    loss = balancing_losses(torch.zeros(8, 4), 1, 2, "softmax", "aux_loss", aux_coeff=0.01, z_coeff=0.0)["load_balancing"]
    assert math.isclose(loss.item(), 0.01, rel_tol=1e-6)


def test_seq_aux_loss_averages_each_sequence_loss():
    torch.manual_seed(2)
    b, s, experts, k = 3, 4, 4, 2
    logits = torch.randn(b * s, experts)
    probs = torch.softmax(logits, -1).view(b, s, experts)
    by_hand = sum(_switch_loss_by_hand(probs[i].tolist(), probs[i].topk(k).indices.tolist()) for i in range(b)) / b
    loss = balancing_losses(logits, b, k, "softmax", "seq_aux_loss", aux_coeff=1.0, z_coeff=0.0)["load_balancing"]
    assert math.isclose(loss.item(), by_hand, rel_tol=1e-6)
    batch_loss = balancing_losses(logits, b, k, "softmax", "aux_loss", aux_coeff=1.0, z_coeff=0.0)["load_balancing"]
    assert not math.isclose(loss.item(), batch_loss.item(), rel_tol=1e-3)


def test_z_loss_matches_formula_and_none_disables_balancing():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 0.5]])
    by_hand = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 2
    losses = balancing_losses(logits, 1, 1, "softmax", "none", aux_coeff=0.5, z_coeff=1e-3)
    assert set(losses) == {"z_loss"}
    assert math.isclose(losses["z_loss"].item(), 1e-3 * by_hand, rel_tol=1e-6)


def _layer(**fields) -> MoELayer:
    cfg = ModelConfig(num_layers=4, hidden_size=16, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8,
                      add_bias_linear=False, **fields)  # fmt: skip
    return MoELayer(cfg)


def test_layer_losses_reach_the_router_only():
    torch.manual_seed(3)
    layer = _layer(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    layer(torch.randn(2, 5, 16))
    assert set(layer.last_aux_losses) == {"load_balancing", "z_loss"}
    sum(layer.last_aux_losses.values()).backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert layer.experts.weight1.grad is None and layer.experts.weight2.grad is None
    assert int(layer.last_tokens_per_expert.sum()) == 2 * 5 * 2


def test_megablocks_loss_weight_is_averaged_over_moe_layers():
    cfg = ModelConfig(num_layers=4, num_experts=4, moe_layer_freq="2", moe_loss_weight=0.1)
    assert math.isclose(aux_loss_coeff(cfg, 2), 0.05)
    assert math.isclose(_layer(moe_layer_freq="2", moe_loss_weight=0.1).aux_loss_coeff, 0.05)
    assert _layer(moe_aux_loss_coeff=0.01).aux_loss_coeff == 0.01
