"""FP8 experts under expert parallelism (2 gloo processes, bf16, the CPU's reference FP8 path):
each rank's outputs, input gradients and its experts' weight gradients equal one process's
experts fed every rank's rows, bit for bit, with the alltoall and allgather dispatchers and the
overlapped all-to-all. Each expert gets the same rows in the same order on either layout, the
scales are per row and per (expert, channel), so nothing may differ."""

from __future__ import annotations

import pytest
import torch

from launcher import by_name, run_distributed
from meshtron.config import ModelConfig
from meshtron.layers.moe.experts import Experts
from meshtron.parallel.expert_parallel import ExpertParallelExperts
from meshtron.parallel.mesh import Mesh

CFG = ModelConfig(num_layers=2, hidden_size=64, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, add_bias_linear=False,
                  activation="swiglu", fp8_format="e4m3", moe_fp8="rowwise")  # fmt: skip
ROWS = [[5, 0, 3, 4], [2, 6, 0, 1]]  # rows each rank hands each global expert: expert 1 and 2 get one rank's only
CASES = {"alltoall": ("alltoall", 0), "allgather": ("allgather", 0), "alltoall_overlapped": ("alltoall", 2)}


def _experts() -> Experts:
    torch.manual_seed(5)
    return Experts(CFG).to(torch.bfloat16)


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    sizes = torch.tensor(ROWS[rank])
    rows = int(sizes.sum())
    x = torch.randn(rows, CFG.hidden_size, generator=g).to(torch.bfloat16)
    return x, sizes, torch.randn(rows, CFG.hidden_size, generator=g).to(torch.bfloat16)


def _worker(rank: int, world_size: int) -> dict:
    mesh = Mesh(dp=2, ep=2, rank=rank)
    mesh.init_process_groups()
    results = {}
    for name, (dispatcher, chunks) in CASES.items():
        experts = ExpertParallelExperts(_experts(), mesh, dispatcher, overlap_chunks=chunks)
        x, sizes, weighting = _inputs(rank)
        x.requires_grad_(True)
        out = experts(x, sizes)
        (out.float() * weighting.float()).sum().backward()
        results[name] = {"out": out.detach(), "x_grad": x.grad, "grads": {n: p.grad for n, p in experts.named_parameters()}}
    return results


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return by_name(run_distributed(_worker, 2))


def _one_process() -> tuple[Experts, list[dict]]:
    """One process's experts fed every rank's rows in one call, each expert's rows in rank order
    (as the exchange delivers them): (the experts with their gradients, each rank's results)."""
    experts = _experts()
    inputs = [_inputs(rank) for rank in range(2)]
    for x, _, _ in inputs:
        x.requires_grad_(True)
    parts = [list(torch.split(torch.arange(x.shape[0]), sizes.tolist())) for x, sizes, _ in inputs]
    order = [(rank, parts[rank][e]) for e in range(CFG.num_experts) for rank in range(2)]
    x_all = torch.cat([inputs[rank][0][part] for rank, part in order])
    out_all = experts(x_all, sum(sizes for _, sizes, _ in inputs))
    weighting_all = torch.cat([inputs[rank][2][part] for rank, part in order])
    (out_all.float() * weighting_all.float()).sum().backward()
    outs = [torch.empty_like(x) for x, _, _ in inputs]
    for (rank, part), out in zip(order, torch.split(out_all.detach(), [len(p) for _, p in order])):
        outs[rank][part] = out
    return experts, [{"out": outs[rank], "x_grad": inputs[rank][0].grad} for rank in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_experts_under_ep2_equal_one_process_bit_for_bit(runs, case):
    experts, expected = _one_process()
    for rank in range(2):
        got = runs[case][rank]
        assert torch.equal(got["out"], expected[rank]["out"]) and torch.equal(got["x_grad"], expected[rank]["x_grad"])
        local = slice(2 * rank, 2 * rank + 2)
        for name, grad in got["grads"].items():
            assert torch.equal(grad, getattr(experts, name).grad[local]), f"{case} rank {rank} {name}"
