"""The FP8 output layer (``--fp8-output-layer``) on vocabulary shards (tp2, two gloo processes):
``VocabParallelOutputLayer``'s fused loss with an FP8 state per rank against the one-process
``OutputLayer`` with one: loss, hidden gradient (summed over the shards) and each shard's weight
gradient, over two calls (delayed scaling's second call reads the histories).

The weight's largest element is put in both halves, so each rank's shard has the whole weight's
amax and scale: the FP8 copies are bytes of the one-process copies, and only fp32's summation order
(the log-sum-exp combined over tp, the hidden gradient summed over shards) may differ: 1e-5 allowed
(bit-equal measured on the CPU). The gradients without FP8 are 3e-2 to 5e-2 away, so FP8 ran on both sides.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from launcher import run_distributed
from meshtron.config import ParallelConfig
from meshtron.kernels.fp8_scaling import Fp8Recipe, Fp8Scaling
from meshtron.layers.output import OutputLayer
from meshtron.parallel.mesh import Mesh
from meshtron.parallel.tensor_parallel import VocabParallelOutputLayer

VOCAB, HIDDEN, TOL = 320, 32, 1e-5
RECIPES = ("delayed", "tensorwise")


def _inputs():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    weight[0, 0] = weight[VOCAB // 2, 1] = -2.0  # each tp2 shard holds the whole weight's amax
    hidden = torch.randn(2, 16, HIDDEN, generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels[0, :3] = -100
    mask = (torch.rand(2, 16, generator=g) > 0.2).float() * 1.5
    return weight, hidden, labels, mask


def _two_calls(layer: nn.Module) -> list[tuple[torch.Tensor, ...]]:
    """Loss, hidden gradient and weight gradient of two calls (the second on larger hidden states)."""
    _, hidden, labels, mask = _inputs()
    out = []
    for size in (1.0, 1.5):
        h = (hidden * size).requires_grad_()
        layer.weight.grad = None
        total = layer(h, labels, loss_weights=mask)
        total.backward()
        out.append((total.detach(), h.grad, layer.weight.grad.clone()))
    return out


def _worker(rank: int, world_size: int) -> dict[str, list]:
    mesh = Mesh.from_config(ParallelConfig(tensor_parallel=world_size))
    mesh.init_process_groups()
    weight = _inputs()[0]
    shard = VOCAB // world_size
    results = {}
    for recipe in RECIPES:
        layer = VocabParallelOutputLayer(mesh.tp_group, sequence_parallel=False)
        layer.weight = nn.Parameter(weight[rank * shard : (rank + 1) * shard].clone())
        layer.fp8 = Fp8Scaling(Fp8Recipe("hybrid", recipe))
        results[recipe] = _two_calls(layer)
    return results


def _one_process(recipe: str | None) -> list[tuple[torch.Tensor, ...]]:
    layer = OutputLayer(HIDDEN, VOCAB, tied=False)
    layer.weight.data.copy_(_inputs()[0])
    layer.fp8 = None if recipe is None else Fp8Scaling(Fp8Recipe("hybrid", recipe))
    return _two_calls(layer)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_vocab_shards_equal_one_process_fp8(results, recipe):
    want, plain = _one_process(recipe), _one_process(None)
    shard = VOCAB // 2
    for rank, result in enumerate(results):
        for call, (got, one, bf) in enumerate(zip(result[recipe], want, plain)):
            total, grad_hidden, grad_weight = got
            pairs = {"loss": (total, one[0]), "hidden grad": (grad_hidden, one[1]),
                     "weight grad": (grad_weight, one[2][rank * shard : (rank + 1) * shard])}  # fmt: skip
            for name, (g, w) in pairs.items():
                assert _rel(g, w) < TOL, f"rank {rank} call {call} {name}: {_rel(g, w):.2e}"
            assert _rel(one[1], bf[1]) > 100 * TOL, "the one-process loss did not run FP8"
