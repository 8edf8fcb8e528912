"""Sinkhorn routing (``--moe-router-load-balancing-type sinkhorn``, Megatron-Core's): the plan's
marginals, its balancing, eval's plain top-k, the combine weights, and training through it.
(Layout invariance over sp/cp ranks: tests/distributed/test_expert_parallel.py.)"""

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.layers.moe import MoELayer
from meshtron.layers.moe.balancing import sinkhorn
from meshtron.layers.moe.router import Router, sinkhorn_routing

T, E = 256, 8
SKEW = torch.linspace(3.0, 0.0, E)  # every token leans towards the low expert ids


def _skewed_logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) + SKEW


def _cfg(**fields) -> ModelConfig:
    defaults = dict(num_layers=1, hidden_size=16, num_experts=E, moe_router_topk=2, moe_ffn_hidden_size=8, add_bias_linear=False,
                    activation="swiglu", moe_router_load_balancing_type="sinkhorn")  # fmt: skip
    return ModelConfig(**{**defaults, **fields})


def test_plan_rows_sum_to_one_over_tokens_and_columns_to_one_over_experts():
    plan = sinkhorn(_skewed_logits())
    torch.testing.assert_close(plan.sum(dim=0), torch.full((E,), 1 / E), rtol=1e-6, atol=0)
    torch.testing.assert_close(plan.sum(dim=1), torch.full((T,), 1 / T), rtol=1e-3, atol=0)  # to the stopping tolerance


def _megatron_sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> tuple[torch.Tensor, int]:
    """Megatron-Core's ``moe_utils.sinkhorn`` as written there (a host read of the error every
    iteration), and how many iterations it ran."""
    cost = torch.exp(cost)
    d0, d1 = torch.ones(cost.size(0)), torch.ones(cost.size(1))
    eps, error, d1_old, iterations = 1e-8, 1e9, d1, 0
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old, iterations = d1, iterations + 1
    return d1 * cost * d0.unsqueeze(1), iterations


@pytest.mark.parametrize("scale, iterations", [(1.0, 6), (1.4, 8), (1.5, 9), (2.5, 17)])
def test_plan_is_megatrons_though_the_stopping_test_is_read_in_blocks(scale, iterations):
    """The stopping test is read once per block of 8 iterations; the plan returned is still the
    one of the iteration where Megatron-Core's loop stops, bit for bit: inside the first block,
    at its end, just after it, and in the third."""
    logits = _skewed_logits() * scale
    expected, ran = _megatron_sinkhorn(logits)
    assert ran == iterations
    assert torch.equal(sinkhorn(logits), expected)


def test_plan_spreads_tokens_more_evenly_than_top_k():
    logits = _skewed_logits()
    for k in (1, 2):
        plain = torch.bincount(logits.topk(k, dim=-1).indices.reshape(-1), minlength=E)
        balanced = torch.bincount(sinkhorn_routing(logits, k)[1].reshape(-1), minlength=E)
        assert plain.min() * 10 < plain.max(), f"k {k}: the skew should unbalance plain top-k: {plain.tolist()}"
        assert balanced.max() < 2 * balanced.min(), f"k {k}: sinkhorn's choice is not balanced: {balanced.tolist()}"


@pytest.mark.parametrize("k, activation", [(1, torch.sigmoid), (2, lambda x: torch.softmax(x, dim=-1))], ids=["k1 sigmoid", "k2 softmax"])
def test_weights_are_the_activation_at_the_chosen_experts_not_renormalized(k, activation):
    logits = _skewed_logits()
    expected = activation(logits)
    for training in (True, False):
        probs, experts = sinkhorn_routing(logits, k, training=training)
        torch.testing.assert_close(probs, expected.gather(1, experts))
    # Eval: the plain top-k of the activation, and (k 2) weights that do not sum to 1.
    torch.testing.assert_close(experts, expected.topk(k, dim=-1).indices, rtol=0, atol=0)
    assert not torch.allclose(probs.sum(dim=-1), torch.ones(T))
    assert not torch.equal(sinkhorn_routing(logits, k)[1], experts), "training should choose from the plan, not the top-k"


def test_router_keeps_the_logits_dtype_and_the_gate_gets_a_gradient():
    torch.manual_seed(0)
    router = Router(_cfg(moe_router_topk=1)).train().to(torch.bfloat16)
    routing = router(torch.randn(64, 16, dtype=torch.bfloat16))
    assert routing.probs.dtype == torch.bfloat16
    routing.probs.float().sum().backward()
    assert router.weight.grad.abs().sum() > 0


def test_moe_layer_trains_with_sinkhorn_routing():
    torch.manual_seed(0)
    layer = MoELayer(_cfg(moe_z_loss_coeff=1e-3)).train()
    x, target = torch.randn(2, 32, 16), torch.randn(2, 32, 16)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = (layer(x) - target).square().mean() + sum(layer.last_aux_losses.values())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert set(layer.last_aux_losses) == {"z_loss"}  # no balancing loss: the plan balances
    assert losses[-1] < losses[0], losses


def test_plan_that_does_not_converge_names_the_flag():
    logits = torch.zeros(4, E)
    logits[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="--moe-router-load-balancing-type sinkhorn: no routing plan, its scalings are not finite"):
        sinkhorn(logits)
